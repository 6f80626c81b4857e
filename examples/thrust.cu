// Thrust on streamalloc, through CCCL: a Thrust allocator written against CCCL's type-erased
// `cuda::mr::async_resource_ref<device_accessible>` (so any CCCL resource fits), given a
// streamalloc pool_resource. A device_vector takes its memory from the pool in stream order,
// and thrust::sort's temporary storage comes from the same pool, on a streamalloc stream.
// No cudaMalloc anywhere.

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <thrust/device_malloc_allocator.h>
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/reduce.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>

#include <cstdio>

namespace thrust_example {

/// A Thrust allocator over any CCCL stream-ordered device resource, allocating and freeing in
/// the order of one stream (thrust's algorithms then run on that stream too).
template <class T>
class pool_allocator : public thrust::device_malloc_allocator<T> {
 public:
  using value_type = T;
  using pointer = thrust::device_ptr<T>;
  using size_type = std::size_t;
  template <class U>
  struct rebind {
    using other = pool_allocator<U>;
  };

  using resource_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
  pool_allocator(resource_ref mr, cuda::stream_ref s) : mr_(mr), s_(s) {}
  template <class U>
  pool_allocator(const pool_allocator<U>& o) : mr_(o.resource()), s_(o.stream()) {}

  pointer allocate(size_type n) { return pointer(static_cast<T*>(mr_.allocate_async(n * sizeof(T), 256, s_))); }
  void deallocate(pointer p, size_type n) { mr_.deallocate_async(p.get(), n * sizeof(T), 256, s_); }

  resource_ref resource() const { return mr_; }
  cuda::stream_ref stream() const { return s_; }
  friend bool operator==(const pool_allocator& a, const pool_allocator& b) { return a.mr_ == b.mr_ && a.s_ == b.s_; }
  friend bool operator!=(const pool_allocator& a, const pool_allocator& b) { return !(a == b); }

 private:
  resource_ref mr_;
  cuda::stream_ref s_;
};

}  // namespace thrust_example
using thrust_example::pool_allocator;

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  streamalloc::pool pool;
  streamalloc::stream s(0);
  streamalloc::device_resource mr(pool);
  static_assert(cuda::mr::async_resource_with<streamalloc::device_resource, cuda::mr::device_accessible>);
  const cuda::stream_ref cs(s.get());
  pool_allocator<int> alloc(mr, cs);
  const auto policy = thrust::cuda::par_nosync(pool_allocator<char>(mr, cs)).on(s.get());

  constexpr int n = 1 << 24;
  {
    thrust::device_vector<int, pool_allocator<int>> v(n, 0, alloc);
    thrust::sequence(policy, v.begin(), v.end(), n, -1);  // n, n-1, ..., 1
    const auto during = pool.statistics();
    thrust::sort(policy, v.begin(), v.end());  // radix sort: temporary storage from the pool
    const long long sum = thrust::reduce(policy, v.begin(), v.end(), 0LL);
    const int first = v[0], last = v[n - 1];
    std::printf("thrust sorted %d ints from a streamalloc pool: first %d, last %d, sum %lld; pool used %zu MiB, "
                "%zu MiB reserved (sort temporaries included)\n",
                n, first, last, sum, during.used_current >> 20, pool.statistics().reserved_high >> 20);
    example::expect(first == 1 && last == n && sum == static_cast<long long>(n) * (n + 1) / 2, "thrust results");
    example::expect(pool.owns(thrust::raw_pointer_cast(v.data())), "vector memory from the pool");
  }
  (void)s.synchronize();
  example::expect(pool.statistics().live_allocations == 0, "everything freed");
  std::printf("thrust OK\n");
  return 0;
}
