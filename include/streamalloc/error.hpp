#pragma once

/// @file
/// @brief The exceptions streamalloc throws for driver failures.

#include <streamalloc/detail/driver/driver_loader.hpp>

#include <stdexcept>
#include <string>
#include <string_view>

namespace streamalloc {

namespace detail {
struct cu_get_error_name_entry {
  static constexpr const char* name = "cuGetErrorName";
  static constexpr int version = 12000;
  using pointer = decltype(&::cuGetErrorName);
};
struct cu_get_error_string_entry {
  static constexpr const char* name = "cuGetErrorString";
  static constexpr int version = 12000;
  using pointer = decltype(&::cuGetErrorString);
};

/// The driver's name for a CUresult ("CUDA_ERROR_INVALID_VALUE"), or "CUresult N" when the
/// driver is not there to say.
inline std::string result_name(CUresult code) {
  CUresult st = CUDA_SUCCESS;
  const char* text = nullptr;
  if (auto fn = driver_entry<cu_get_error_name_entry>(st); fn != nullptr && fn(code, &text) ==
                                                                               CUDA_SUCCESS &&
                                                           text != nullptr) {
    return text;
  }
  switch (code) {  // the codes streamalloc itself reports when no driver could be asked
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    default: return "CUresult " + std::to_string(static_cast<int>(code));
  }
}

/// The driver's description of a CUresult, or an empty string when unknown.
inline std::string result_description(CUresult code) {
  CUresult st = CUDA_SUCCESS;
  const char* text = nullptr;
  if (auto fn = driver_entry<cu_get_error_string_entry>(st); fn != nullptr && fn(code, &text) ==
                                                                                 CUDA_SUCCESS &&
                                                             text != nullptr) {
    return text;
  }
  return {};
}
}  // namespace detail

/**
 * @brief A CUDA driver call failed.
 *
 * Carries the `CUresult`, its name and description as the driver gives them, the call that
 * failed and, where streamalloc knows it, what it was trying to do. An argument streamalloc can
 * judge before asking the driver is refused with `std::invalid_argument` instead, never with a
 * `cuda_error` naming a call that was not made.
 *
 * @code
 * try {
 *   streamalloc::physical_allocation mem(size, streamalloc::memory_location::device(0));
 * } catch (const streamalloc::cuda_error& e) {
 *   if (e.code() == CUDA_ERROR_OUT_OF_MEMORY) { ... }
 *   std::cerr << e.what() << '\n';  // names the call, the error and the context
 * }
 * @endcode
 */
class cuda_error : public std::runtime_error {
 public:
  /// @param code the driver's result
  /// @param call the driver function that returned it ("cuMemMap")
  /// @param context what streamalloc was doing, for the message; may be empty
  cuda_error(CUresult code, std::string_view call, std::string_view context = {})
      : cuda_error(code, std::string(call), detail::result_name(code),
                   detail::result_description(code), std::string(context)) {}

  /// A CUDA runtime call's failure (`call`: "cudaMemcpyAsync"), named as the runtime names it:
  /// `name()` and `description()` are the runtime's (cudaGetErrorName, cudaGetErrorString), not
  /// those of the driver result with the same number, and `code()` holds the runtime's
  /// cudaError_t value, which equals the driver's result for the errors the runtime passes on.
  [[nodiscard]] static cuda_error from_runtime(int code, std::string_view call, std::string_view name,
                                               std::string_view description, std::string_view context = {}) {
    return cuda_error(static_cast<CUresult>(code), std::string(call), std::string(name), std::string(description),
                      std::string(context));
  }

  /// The driver's result code (for `from_runtime`, the runtime's).
  [[nodiscard]] CUresult code() const noexcept { return code_; }
  /// The driver function that failed, e.g. "cuMemMap".
  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  /// The result's name, e.g. "CUDA_ERROR_INVALID_VALUE".
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The driver's description of the result; empty when the driver could not be asked.
  [[nodiscard]] const std::string& description() const noexcept { return description_; }

 private:
  cuda_error(CUresult code, std::string call, std::string name, std::string description,
             std::string context)
      : std::runtime_error(message(call, name, description, context)),
        code_(code),
        call_(std::move(call)),
        name_(std::move(name)),
        description_(std::move(description)) {}

  static std::string message(const std::string& call, const std::string& name,
                             const std::string& description, const std::string& context) {
    std::string m = "streamalloc: " + call + " failed: " + name;
    if (!description.empty()) m += " (" + description + ")";
    if (!context.empty()) m += ": " + context;
    return m;
  }

  CUresult code_;
  std::string call_;
  std::string name_;
  std::string description_;
};

/**
 * @brief The CUDA driver cannot be used: it is not installed, too old, or finds no device.
 *
 * `code()` is `CUDA_ERROR_NO_DEVICE` when there is no driver library or no device, and
 * `CUDA_ERROR_NOT_SUPPORTED` when the driver is older than streamalloc needs.
 */
class driver_unavailable : public cuda_error {
 public:
  using cuda_error::cuda_error;
};

/**
 * @brief The device or driver lacks a capability that was asked for: virtual memory
 * management, a shareable handle type, a location kind. `code()` is `CUDA_ERROR_NOT_SUPPORTED`.
 */
class not_supported : public cuda_error {
 public:
  /// `what`: the capability that is missing, as the message says it.
  explicit not_supported(std::string_view what)
      : cuda_error(CUDA_ERROR_NOT_SUPPORTED, "capability check", what) {}
};

}  // namespace streamalloc
