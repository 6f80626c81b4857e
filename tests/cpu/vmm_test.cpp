// The VMM layer's ownership against the fake driver: every object released exactly once,
// moved-from objects release nothing, failures leak nothing. What the real driver does with
// the memory is the GPU tests' job (tests/gpu/vmm_test.cu).

#include <streamalloc/vmm.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <stdexcept>
#include <string>
#include <utility>

using namespace streamalloc;
using streamalloc_test::contains;
using streamalloc_test::fake_live;
using streamalloc_test::MiB;

namespace {
const auto gpu0 = memory_location::device(0);

void require_nothing_live() {
  const auto live = fake_live();
  REQUIRE(live.reservations == 0);
  REQUIRE(live.handles == 0);
  REQUIRE(live.physicals == 0);
  REQUIRE(live.mappings == 0);
  REQUIRE(live.used_device0 == 0);
}
}  // namespace

TEST_SUITE("vmm") {
  TEST_CASE("a reservation is freed once, by whoever owns it last") {
    require_nothing_live();
    {
      address_reservation a(64 * MiB);
      CHECK(a.size() == 64 * MiB);
      CHECK(a.address() != 0);
      CHECK(a.contains(a.address(), 64 * MiB));
      CHECK_FALSE(a.contains(a.address() + 1, 64 * MiB));
      CHECK(fake_live().reservations == 1);

      address_reservation b(std::move(a));
      CHECK_FALSE(a);
      CHECK(b);
      address_reservation c;
      c = std::move(b);
      CHECK(fake_live().reservations == 1);
      c = address_reservation(8 * MiB);  // the old range is freed, the new one kept
      CHECK(fake_live().reservations == 1);
      CHECK(c.size() == 8 * MiB);
    }
    require_nothing_live();
  }

  TEST_CASE("bad reservation arguments are rejected before the driver is asked") {
    CHECK_THROWS_AS(address_reservation(0), std::invalid_argument);
    CHECK_THROWS_AS(address_reservation(4 * MiB, 3 * MiB), std::invalid_argument);
    CHECK_THROWS_AS(address_reservation(std::size_t{1} << 60), cuda_error);  // absurd: driver says no
    require_nothing_live();
  }

  TEST_CASE("physical memory is released once and counted while it lives") {
    {
      physical_allocation a(4 * MiB, gpu0);
      CHECK(a.size() == 4 * MiB);
      CHECK(a.location() == gpu0);
      CHECK(fake_live().used_device0 == 4 * MiB);
      physical_allocation b = std::move(a);
      CHECK_FALSE(a);
      CHECK(fake_live().handles == 1);
    }
    require_nothing_live();
  }

  TEST_CASE("zero, unaligned and absurd sizes fail cleanly") {
    CHECK_THROWS_AS(physical_allocation(0, gpu0), std::invalid_argument);
    try {
      physical_allocation bad(3 * MiB, gpu0);
      FAIL("should have thrown");
    } catch (const std::invalid_argument& e) {
      CHECK(contains(e.what(), "granularity"));
    }
    try {
      physical_allocation huge(1024 * 1024 * MiB, gpu0);  // 1 TiB on an 8 GiB fake device
      FAIL("should have thrown");
    } catch (const cuda_error& e) {
      CHECK(e.code() == CUDA_ERROR_OUT_OF_MEMORY);
      CHECK(e.call() == "cuMemCreate");
    }
    CHECK_THROWS_AS(physical_allocation(2 * MiB, memory_location::device(7)), cuda_error);
    require_nothing_live();
  }

  TEST_CASE("a mapping keeps physical memory alive after its handle is released") {
    {
      address_reservation va(16 * MiB);
      mapping m;
      {
        physical_allocation mem(4 * MiB, gpu0);
        m = mapping(va, 2 * MiB, mem);
        CHECK(m.address() == va.address() + 2 * MiB);
        CHECK(m.size() == 4 * MiB);
      }
      CHECK(fake_live().handles == 0);    // the handle is gone
      CHECK(fake_live().physicals == 1);  // the memory is not
      CHECK(fake_live().used_device0 == 4 * MiB);
      m.unmap();
      CHECK(fake_live().physicals == 0);
    }
    require_nothing_live();
  }

  TEST_CASE("mapping past the reservation is a bad argument, refused before the driver maps anything") {
    {
      address_reservation va(4 * MiB);
      physical_allocation mem(4 * MiB, gpu0);
      // Not a cuda_error: no driver call was made, so none can be named.
      try {
        mapping m(va, 2 * MiB, mem);
        FAIL("should have thrown");
      } catch (const std::invalid_argument& e) {
        CHECK(contains(e.what(), "streamalloc::mapping"));
        CHECK(contains(e.what(), "at offset 2097152 of a reservation of 4194304 bytes"));
        CHECK(contains(e.what(), "leaves the reservation"));
      }
      // An offset so large that the address would wrap around.
      CHECK_THROWS_WITH_AS(mapping(va, std::size_t{1} << 62, mem),
                           doctest::Contains("leaves the reservation"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(mapping(va, 4 * MiB, mem), doctest::Contains("leaves the reservation"),
                           std::invalid_argument);
      CHECK(fake_live().mappings == 0);
      // Nothing was mapped: the whole reservation is still free for the memory.
      mapping ok(va, 0, mem);
      CHECK(ok.address() == va.address());
      CHECK(fake_live().mappings == 1);
    }
    require_nothing_live();
  }

  TEST_CASE("a buffer grows in place: more memory mapped after it, same address") {
    {
      address_reservation va(16 * MiB);
      physical_allocation first(4 * MiB, gpu0);
      mapping m1(va, 0, first);
      set_access(m1.address(), m1.size(), {{gpu0, access_flags::read_write}});
      const CUdeviceptr base = m1.address();

      physical_allocation second(4 * MiB, gpu0);
      mapping m2(va, 4 * MiB, second);
      set_access(m2.address(), m2.size(), {{gpu0, access_flags::read_write}});
      CHECK(m1.address() == base);
      CHECK(m2.address() == base + 4 * MiB);
      CHECK(get_access(gpu0, base) == access_flags::read_write);
      CHECK(get_access(gpu0, base + 6 * MiB) == access_flags::read_write);
      // One call may cover both mappings once they are contiguous.
      CHECK_NOTHROW(set_access(base, 8 * MiB, {{gpu0, access_flags::read}}));
      CHECK(get_access(gpu0, base + 7 * MiB) == access_flags::read);
      // But not a range with an unmapped gap.
      CHECK_THROWS_AS(set_access(base, 12 * MiB, {{gpu0, access_flags::read}}), cuda_error);
    }
    require_nothing_live();
  }

  TEST_CASE("an access_grant takes its access back") {
    {
      address_reservation va(4 * MiB);
      physical_allocation mem(4 * MiB, gpu0);
      mapping m(va, 0, mem);
      {
        access_grant g(m.address(), m.size(), {{gpu0, access_flags::read_write}});
        CHECK(get_access(gpu0, m.address()) == access_flags::read_write);
        access_grant moved = std::move(g);
        CHECK(get_access(gpu0, m.address()) == access_flags::read_write);  // a move keeps it
      }
      CHECK(get_access(gpu0, m.address()) == access_flags::none);
    }
    require_nothing_live();
  }

  TEST_CASE("exported memory is imported as another handle to the same memory") {
    {
      physical_allocation mem(2 * MiB, gpu0, {.handle_types = shareable_handle_type::posix_fd});
      unique_fd fd = mem.export_to_fd();
      REQUIRE(fd);
      physical_allocation imported = physical_allocation::import_from_fd(fd.get(), mem.size());
      CHECK(imported.handle() != mem.handle());
      CHECK(imported.location() == gpu0);
      CHECK(has_handle_type(imported.handle_types(), shareable_handle_type::posix_fd));
      CHECK(fake_live().handles == 2);
      CHECK(fake_live().physicals == 1);
    }
    require_nothing_live();
  }

  TEST_CASE("export needs the handle type at creation; bad descriptors are refused") {
    physical_allocation plain(2 * MiB, gpu0);
    CHECK_THROWS_AS((void)plain.export_to_fd(), not_supported);
    CHECK_THROWS_AS((void)physical_allocation::import_from_fd(-1, 2 * MiB), std::invalid_argument);
    CHECK_THROWS_AS((void)physical_allocation::import_from_fd(0, 0), std::invalid_argument);
    CHECK_THROWS_AS((void)physical_allocation::import_from_fd(1000, 2 * MiB), std::invalid_argument);  // not open
    CHECK_THROWS_AS((void)physical_allocation::import_from_fd(0, 2 * MiB), cuda_error);  // open, not exported
  }

  TEST_CASE("release() hands ownership over") {
    physical_allocation mem(2 * MiB, gpu0);
    const CUmemGenericAllocationHandle h = mem.release();
    CHECK_FALSE(mem);
    CHECK(fake_live().handles == 1);
    CHECK(detail::cu::cuMemRelease_nothrow(h) == CUDA_SUCCESS);
    require_nothing_live();
  }
}

TEST_SUITE("no_posix_fd") {
  TEST_CASE("asking for an export type the device lacks is not_supported, not a bare driver code") {
    try {
      physical_allocation mem(2 * MiB, gpu0, {.handle_types = shareable_handle_type::posix_fd});
      FAIL("should have thrown");
    } catch (const not_supported& e) {
      CHECK(contains(e.what(), "POSIX file descriptors"));
    }
    require_nothing_live();
  }
}
