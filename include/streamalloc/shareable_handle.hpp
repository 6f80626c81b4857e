#pragma once

/// @file
/// @brief Kinds of handle through which physical memory is shared with other processes, and an
/// owning POSIX file descriptor.

#include <streamalloc/detail/config.hpp>

#include <unistd.h>

#include <utility>

namespace streamalloc {

/// Handle types a physical allocation can be exported as. Combine with `|`.
enum class shareable_handle_type : unsigned {
  none = 0,
  posix_fd = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,  ///< a file descriptor, passed by SCM_RIGHTS or inheritance
  fabric = CU_MEM_HANDLE_TYPE_FABRIC,                   ///< an opaque blob usable across nodes (IMEX)
};

/// Both sets of handle types.
[[nodiscard]] constexpr shareable_handle_type operator|(shareable_handle_type a,
                                                        shareable_handle_type b) noexcept {
  return static_cast<shareable_handle_type>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
/// Does `set` include handle type `t` (never true for `none`)?
[[nodiscard]] constexpr bool has_handle_type(shareable_handle_type set,
                                             shareable_handle_type t) noexcept {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(t)) == static_cast<unsigned>(t) &&
         t != shareable_handle_type::none;
}

/**
 * @brief An owned POSIX file descriptor, closed on destruction.
 *
 * Returned by `physical_allocation::export_to_fd`. `release()` hands the descriptor over to the
 * caller (to send it with SCM_RIGHTS, or to let a child process inherit it).
 */
class unique_fd {
 public:
  constexpr unique_fd() noexcept = default;
  /// Takes ownership of `fd` (-1 for none).
  constexpr explicit unique_fd(int fd) noexcept : fd_(fd) {}
  /// Takes over `other`'s descriptor; `other` is left empty.
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  /// Closes this descriptor, then takes over `other`'s.
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  /// The descriptor; -1 when empty.
  [[nodiscard]] int get() const noexcept { return fd_; }
  /// True while it owns a descriptor.
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Gives up ownership and returns the descriptor.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes the descriptor, if any.
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

}  // namespace streamalloc
