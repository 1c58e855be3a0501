// Slot and host-cache bookkeeping of adapters (see adapter_pool.h).
#include "runtime/adapter_pool.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace moelora::runtime {

AdapterPool::AdapterPool(int32_t num_slots, int32_t host_cache_capacity, SlotWriter& writer,
                         AdapterLoader loader)
    : writer_(writer), loader_(std::move(loader)), host_capacity_(host_cache_capacity) {
  MOELORA_CHECK(num_slots >= 0, ErrorCode::kInvalidArgument, "adapter_slots must be >= 0, got ",
                num_slots);
  MOELORA_CHECK(host_cache_capacity >= 0, ErrorCode::kInvalidArgument,
                "host_adapter_cache must be >= 0, got ", host_cache_capacity);
  slots_.resize(static_cast<size_t>(num_slots));
}

AdapterPool::Registered& AdapterPool::registered(const std::string& name) {
  return const_cast<Registered&>(std::as_const(*this).registered(name));
}

const AdapterPool::Registered& AdapterPool::registered(const std::string& name) const {
  auto it = adapters_.find(name);
  if (it == adapters_.end()) {
    std::string known;
    for (const auto& [n, r] : adapters_) known += (known.empty() ? "" : ", ") + n;
    MOELORA_THROW(
        ErrorCode::kNotFound, "unknown adapter '", name, "'; ",
        known.empty() ? std::string("no adapters are registered") : "registered: " + known);
  }
  return it->second;
}

void AdapterPool::add(const std::string& name, const std::filesystem::path& dir, bool pin) {
  MOELORA_CHECK(!name.empty(), ErrorCode::kInvalidArgument, "an adapter needs a non-empty name (",
                dir.string(), ")");
  MOELORA_CHECK(!contains(name), ErrorCode::kInvalidArgument, "adapter '", name,
                "' is already registered (", adapters_.at(name).dir.string(), ")");
  add(name, dir, loader_(name, dir), pin);
}

void AdapterPool::add(const std::string& name, const std::filesystem::path& dir,
                      io::LoraAdapter adapter, bool pin) {
  MOELORA_CHECK(!name.empty(), ErrorCode::kInvalidArgument, "an adapter needs a non-empty name (",
                dir.string(), ")");
  MOELORA_CHECK(!contains(name), ErrorCode::kInvalidArgument, "adapter '", name,
                "' is already registered (", adapters_.at(name).dir.string(), ")");
  int32_t slot = -1;
  if (pin) {
    slot = pick_slot();
    MOELORA_CHECK(slot >= 0, ErrorCode::kOutOfRange, "cannot pin adapter '", name, "': all ",
                  num_slots(), " adapter slots are pinned or used by running requests (",
                  pinned_count(), " pinned)");
  }
  ++stats_.host_misses;  // the files were read for this registration
  if (pin) {
    load_into(slot, name, adapter);  // throws before anything is registered
    adapters_[name] = Registered{dir, true, slot, 0};
    touch(slot);
  } else {
    adapters_[name] = Registered{dir, false, -1, 0};
  }
  cache_put(name, adapter);
}

void AdapterPool::remove(const std::string& name) {
  Registered& r = registered(name);
  MOELORA_CHECK(r.refcount == 0, ErrorCode::kInvalidArgument, "adapter '", name, "' is used by ",
                r.refcount, " running request", r.refcount == 1 ? "" : "s");
  if (r.slot >= 0) {
    writer_.clear_slot(r.slot);
    slots_[r.slot] = Slot{};
  }
  cache_erase(name);
  adapters_.erase(name);
}

bool AdapterPool::contains(const std::string& name) const {
  return adapters_.count(name) != 0;
}

std::vector<std::string> AdapterPool::names() const {
  std::vector<std::string> out;
  for (const auto& [name, r] : adapters_) out.push_back(name);
  return out;
}

int32_t AdapterPool::refcount(const std::string& name) const {
  return registered(name).refcount;
}

std::optional<int32_t> AdapterPool::slot_of(const std::string& name) const {
  const Registered& r = registered(name);
  if (r.slot < 0) return std::nullopt;
  return r.slot;
}

bool AdapterPool::pinned(const std::string& name) const {
  return registered(name).pinned;
}

int32_t AdapterPool::adapters_in_use() const {
  return static_cast<int32_t>(std::count_if(adapters_.begin(), adapters_.end(),
                                            [](const auto& kv) { return kv.second.refcount > 0; }));
}

int32_t AdapterPool::pinned_count() const {
  return static_cast<int32_t>(std::count_if(adapters_.begin(), adapters_.end(),
                                            [](const auto& kv) { return kv.second.pinned; }));
}

bool AdapterPool::in_host_cache(const std::string& name) const {
  return host_.count(name) != 0;
}

int32_t AdapterPool::pick_slot() const {
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s].name.empty()) return static_cast<int32_t>(s);
  }
  int32_t best = -1;
  for (size_t s = 0; s < slots_.size(); ++s) {
    const Registered& owner = adapters_.at(slots_[s].name);
    if (owner.pinned || owner.refcount > 0) continue;  // never evict what a request uses
    if (best < 0 || slots_[s].last_used < slots_[best].last_used) best = static_cast<int32_t>(s);
  }
  return best;
}

bool AdapterPool::can_acquire(const std::string& name) const {
  return registered(name).slot >= 0 || pick_slot() >= 0;
}

bool AdapterPool::can_ever_acquire(const std::string& name) const {
  const Registered& r = registered(name);
  return r.slot >= 0 || pinned_count() < num_slots();
}

void AdapterPool::load_into(int32_t slot, const std::string& name, const io::LoraAdapter& adapter) {
  Slot& s = slots_[slot];
  if (!s.name.empty()) {  // evict the idle adapter there
    adapters_.at(s.name).slot = -1;
    s.name.clear();
    ++stats_.evictions;
  }
  try {
    writer_.write_slot(slot, adapter);
  } catch (...) {
    // The slot's content is unknown now: leave it empty.
    try {
      writer_.clear_slot(slot);
    } catch (...) {
    }
    throw;
  }
  s.name = name;
}

std::optional<int32_t> AdapterPool::acquire(const std::string& name) {
  Registered& r = registered(name);
  if (r.slot >= 0) {
    ++stats_.hits;
    ++r.refcount;
    touch(r.slot);
    return r.slot;
  }
  const int32_t slot = pick_slot();
  if (slot < 0) return std::nullopt;
  const io::LoraAdapter* cached = cache_get(name);
  io::LoraAdapter loaded;
  if (cached != nullptr) {
    ++stats_.host_hits;
  } else {
    loaded = loader_(name, r.dir);  // may throw: nothing changed yet
    ++stats_.host_misses;
    cache_put(name, loaded);
  }
  load_into(slot, name, cached != nullptr ? *cached : loaded);
  ++stats_.misses;
  r.slot = slot;
  r.refcount = 1;
  touch(slot);
  return slot;
}

void AdapterPool::release(const std::string& name) {
  Registered& r = registered(name);
  MOELORA_CHECK(r.refcount > 0 && r.slot >= 0, ErrorCode::kInternal, "adapter '", name,
                "' released more often than acquired");
  --r.refcount;
  touch(r.slot);
}

std::vector<AdapterPoolEntry> AdapterPool::list() const {
  std::vector<AdapterPoolEntry> out;
  for (const auto& [name, r] : adapters_) {
    out.push_back({name, r.dir, r.pinned, r.slot, r.refcount, in_host_cache(name)});
  }
  return out;
}

void AdapterPool::cache_put(const std::string& name, const io::LoraAdapter& adapter) {
  if (host_capacity_ == 0) return;
  cache_erase(name);
  while (static_cast<int32_t>(host_.size()) >= host_capacity_) cache_erase(host_lru_.back());
  host_lru_.push_front(name);
  host_.emplace(name, Cached{adapter, host_lru_.begin()});
}

const io::LoraAdapter* AdapterPool::cache_get(const std::string& name) {
  auto it = host_.find(name);
  if (it == host_.end()) return nullptr;
  host_lru_.splice(host_lru_.begin(), host_lru_, it->second.lru);  // most recently used
  return &it->second.adapter;
}

void AdapterPool::cache_erase(const std::string& name) {
  auto it = host_.find(name);
  if (it == host_.end()) return;
  host_lru_.erase(it->second.lru);
  host_.erase(it);
}

}  // namespace moelora::runtime
