// AdapterPool: which registered adapter sits in which backend slot, and which are kept in host
// memory. Pure bookkeeping: the backend is reached only through SlotWriter (write / clear one
// slot) and the disk only through an AdapterLoader, so every transition is testable without a
// model.
//
// Three tiers per adapter:
//   registered   name -> directory (and whether it is pinned); always known;
//   host cache   the loaded io::LoraAdapter, for at most host_cache_capacity adapters, least
//                recently used dropped first; a slot load served from here reads no files;
//   slot         resident in one of num_slots backend slots, with a reference count of the
//                running requests that use it.
// Slot choice when an adapter must be loaded: an empty slot first, else the least recently used
// slot that is not pinned and whose refcount is 0 (its adapter is evicted). A slot with refcount
// > 0 is never rewritten: a running request's adapter cannot change under it. A pinned adapter is
// loaded at registration and keeps its slot until it is removed.
//
// Counters (stats()): hits (acquire found the adapter resident), misses (it had to be written
// into a slot), evictions (a resident adapter lost its slot), host_hits / host_misses (a slot
// write served from the host cache / read from disk; registration reads count as misses).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/peft.h"

namespace moelora::runtime {

// The backend side of the pool (Executor::write_slot / clear_slot).
class SlotWriter {
 public:
  virtual ~SlotWriter() = default;
  virtual void write_slot(int32_t slot, const io::LoraAdapter& adapter) = 0;
  virtual void clear_slot(int32_t slot) = 0;
};

// Reads and validates adapter `name` from `dir`; throws moelora::Error on bad files.
using AdapterLoader =
    std::function<io::LoraAdapter(const std::string& name, const std::filesystem::path& dir)>;

struct AdapterPoolStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  int64_t host_hits = 0;
  int64_t host_misses = 0;
};

struct AdapterPoolEntry {
  std::string name;
  std::filesystem::path dir;
  bool pinned = false;
  int32_t slot = -1;  // -1 = not resident
  int32_t refcount = 0;
  bool in_host_cache = false;
};

class AdapterPool {
 public:
  // kInvalidArgument for negative sizes.
  AdapterPool(int32_t num_slots, int32_t host_cache_capacity, SlotWriter& writer,
              AdapterLoader loader);

  // Registers `name`: reads it with the loader (which validates it), keeps it in the host
  // cache; pin: writes it into a slot now and keeps it there. kInvalidArgument for an empty or
  // registered name; kOutOfRange when pinning finds no slot (all pinned or in use). Nothing is
  // registered when it throws.
  void add(const std::string& name, const std::filesystem::path& dir, bool pin = false);
  // The same with an adapter the caller has read already (counted as a host miss).
  void add(const std::string& name, const std::filesystem::path& dir, io::LoraAdapter adapter,
           bool pin);
  // Unregisters `name`, clearing its slot. kNotFound for an unknown name; kInvalidArgument while
  // its refcount is > 0.
  void remove(const std::string& name);

  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;
  int32_t num_slots() const { return static_cast<int32_t>(slots_.size()); }
  int32_t refcount(const std::string& name) const;                // kNotFound for an unknown name
  std::optional<int32_t> slot_of(const std::string& name) const;  // resident slot
  bool in_use(const std::string& name) const { return refcount(name) > 0; }
  bool pinned(const std::string& name) const;
  int32_t adapters_in_use() const;  // distinct adapters with refcount > 0
  int32_t pinned_count() const;
  bool in_host_cache(const std::string& name) const;

  // Whether acquire(name) would get a slot now (resident, an empty slot or an evictable one).
  bool can_acquire(const std::string& name) const;
  // Whether it could ever: false when every slot is pinned to other adapters.
  bool can_ever_acquire(const std::string& name) const;
  // The adapter's slot with its refcount raised by one, loading it first when it is not
  // resident (see the file comment). nullopt, with nothing changed, when no slot is available.
  // Throws when the adapter has to be read from disk and that fails (refcount unchanged; a slot
  // whose write failed is left empty).
  std::optional<int32_t> acquire(const std::string& name);
  // Lowers the refcount (kInternal below zero); the adapter stays resident until evicted.
  void release(const std::string& name);

  std::vector<AdapterPoolEntry> list() const;
  const AdapterPoolStats& stats() const { return stats_; }

 private:
  struct Registered {
    std::filesystem::path dir;
    bool pinned = false;
    int32_t slot = -1;
    int32_t refcount = 0;
  };
  struct Slot {
    std::string name;  // "" = empty
    uint64_t last_used = 0;
  };
  struct Cached {
    io::LoraAdapter adapter;
    std::list<std::string>::iterator lru;  // position in host_lru_
  };

  Registered& registered(const std::string& name);
  const Registered& registered(const std::string& name) const;
  // An empty slot, else the least recently used evictable one; -1 when none.
  int32_t pick_slot() const;
  // Writes `adapter` into `slot`, evicting its current adapter; leaves the slot empty on failure.
  void load_into(int32_t slot, const std::string& name, const io::LoraAdapter& adapter);
  void touch(int32_t slot) { slots_[slot].last_used = ++clock_; }
  void cache_put(const std::string& name, const io::LoraAdapter& adapter);
  const io::LoraAdapter* cache_get(const std::string& name);
  void cache_erase(const std::string& name);

  SlotWriter& writer_;
  AdapterLoader loader_;
  int32_t host_capacity_;
  std::map<std::string, Registered> adapters_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  std::list<std::string> host_lru_;  // front = most recently used
  std::map<std::string, Cached> host_;
  AdapterPoolStats stats_;
};

}  // namespace moelora::runtime
