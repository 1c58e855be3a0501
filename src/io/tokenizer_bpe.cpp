// The BPE model of the tokenizer: turns one pre-token into ids by repeatedly merging the adjacent
// pair of symbols with the lowest merge rank (leftmost first among equal ranks), the procedure of
// `tokenizers` (models/bpe/word.rs). Symbols live in a doubly linked list over an array and the
// candidate merges in a min-heap, so a pre-token of n symbols costs O(n log n) even for the long
// runs of letters that CJK text or minified code produce. Results of short pre-tokens are cached.
#include <algorithm>
#include <functional>
#include <queue>

#include "core/error.h"
#include "io/tokenizer_internal.h"

namespace moelora::io::tokenizer_detail {

BpeModel::BpeModel(StringMap<int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, Options options,
                   const std::string& source)
    : vocab_(std::move(vocab)), options_(options) {
  const auto& alphabet = byte_to_unicode_table();
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(alphabet[b]);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  merges_.reserve(merges.size());
  const auto lookup = [&](const std::string& token, size_t rank, const std::string& role) {
    const auto it = vocab_.find(token);
    MOELORA_CHECK(it != vocab_.end(), ErrorCode::kInvalidFile, source, ": merge #", rank, " ('",
                  merges[rank].first, "' + '", merges[rank].second, "') uses ", role, " '", token,
                  "', which is not in model.vocab");
    return it->second;
  };
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t left_id = lookup(left, rank, "the token");
    const int32_t right_id = lookup(right, rank, "the token");
    const int32_t new_id = lookup(left + right, rank, "the merged token");
    // A repeated pair keeps its last rank, as the hash map that `tokenizers` builds does.
    merges_[pair_key(left_id, right_id)] = MergeResult{static_cast<int32_t>(rank), new_id};
  }
}

const BpeModel::MergeResult* BpeModel::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeModel::merge_symbols(std::vector<int32_t>& symbols) const {
  const int32_t n = static_cast<int32_t>(symbols.size());
  if (n < 2) return;

  // Linked list of live symbols; id -1 marks a symbol merged into its left neighbour.
  struct Symbol {
    int32_t id, prev, next;
  };
  std::vector<Symbol> list(n);
  for (int32_t i = 0; i < n; ++i) list[i] = Symbol{symbols[i], i - 1, i + 1 < n ? i + 1 : -1};

  // A candidate merge of the symbol at `pos` with its right neighbour. Lowest rank first, then
  // leftmost position; a candidate goes stale when either symbol changed since it was pushed.
  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(n);
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap(
      std::greater<Candidate>{}, std::move(storage));
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const MergeResult* m = find_merge(list[i].id, list[i + 1].id))
      heap.push({m->rank, i, m->new_id});
  }

  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = list[top.pos];
    if (left.id < 0 || left.next < 0) continue;
    const int32_t right_pos = left.next;
    // Same staleness test as `tokenizers`: the pair now at `pos` must still produce new_id.
    const MergeResult* current = find_merge(left.id, list[right_pos].id);
    if (current == nullptr || current->new_id != top.new_id) continue;

    left.id = top.new_id;
    left.next = list[right_pos].next;
    if (left.next >= 0) list[left.next].prev = top.pos;
    list[right_pos].id = -1;

    if (left.prev >= 0) {
      if (const MergeResult* m = find_merge(list[left.prev].id, left.id))
        heap.push({m->rank, left.prev, m->new_id});
    }
    if (left.next >= 0) {
      if (const MergeResult* m = find_merge(left.id, list[left.next].id))
        heap.push({m->rank, top.pos, m->new_id});
    }
  }

  symbols.clear();
  for (int32_t i = 0; i >= 0; i = list[i].next) symbols.push_back(list[i].id);
}

void BpeModel::tokenize(std::string_view pre_token, std::vector<int32_t>& out) const {
  if (pre_token.empty()) return;
  if (options_.byte_level && pre_token.size() == 1) {  // most common case in code and numbers
    const int32_t id = byte_ids_[static_cast<uint8_t>(pre_token[0])];
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const bool cacheable = pre_token.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache_->get(pre_token, out)) return;
  const size_t first = out.size();

  if (options_.ignore_merges) {
    const std::string whole =
        options_.byte_level ? byte_level_encode(pre_token) : std::string(pre_token);
    if (const auto it = vocab_.find(whole); it != vocab_.end()) {
      out.push_back(it->second);
      if (cacheable) cache_->put(pre_token, std::span<const int32_t>(out).subspan(first));
      return;
    }
  }

  // Initial symbols: one per byte (byte-level) or per character. A unit missing from the
  // vocabulary becomes unk (consecutive ones fused into one with fuse_unk) or, without an unk
  // token, is dropped, as `tokenizers` does.
  std::vector<int32_t> symbols;
  symbols.reserve(pre_token.size());
  bool previous_unknown = false;
  const auto add_unit = [&](int32_t id) {
    if (id >= 0) {
      symbols.push_back(id);
      previous_unknown = false;
    } else if (options_.unk_id) {
      if (!(options_.fuse_unk && previous_unknown)) symbols.push_back(*options_.unk_id);
      previous_unknown = true;
    }
  };
  if (options_.byte_level) {
    for (char c : pre_token) add_unit(byte_ids_[static_cast<uint8_t>(c)]);
  } else {
    for (size_t pos = 0; pos < pre_token.size();) {
      const size_t begin = pos;
      next_code_point(pre_token, pos);
      const auto it = vocab_.find(pre_token.substr(begin, pos - begin));
      add_unit(it == vocab_.end() ? -1 : it->second);
    }
  }

  merge_symbols(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
  if (cacheable) cache_->put(pre_token, symbols);
}

// ---- WordCache ----

bool WordCache::get(std::string_view word, std::vector<int32_t>& out) const {
  const size_t hash = std::hash<std::string_view>{}(word);
  Shard& shard = shards_[hash % kShards];
  std::lock_guard<std::mutex> lock(shard.mutex);
  const auto it = shard.words.find(word);
  if (it == shard.words.end()) return false;
  out.insert(out.end(), it->second.begin(), it->second.end());
  return true;
}

void WordCache::put(std::string_view word, std::span<const int32_t> ids) const {
  const size_t hash = std::hash<std::string_view>{}(word);
  Shard& shard = shards_[hash % kShards];
  std::lock_guard<std::mutex> lock(shard.mutex);
  if (shard.words.size() >= kEntriesPerShard) shard.words.clear();
  shard.words.emplace(std::string(word), std::vector<int32_t>(ids.begin(), ids.end()));
}

}  // namespace moelora::io::tokenizer_detail
