// A C entry point to SGLang's own NGRAM corpus (its ngram.h, trie.cpp, result.cpp, built from the sglang wheel by
// tests/sglang_trie.py), so that a Python loop can drive it the way NGRAMWorker does, one request at a time.
#include <cstdint>
#include <cstring>
#include <vector>

#include "ngram.h"

using sglang::ngram::Ngram;
using sglang::ngram::Param;

extern "C" {

void* ngram_new(int64_t capacity, int64_t max_trie_depth, int64_t min_bfs_breadth, int64_t max_bfs_breadth,
                int64_t draft_token_num, int64_t match_type) {
  Param param;  // as NgramCorpusObj (ngram_corpus_ffi.cpp) fills it (match_type 0: BFS, 1: PROB), no external corpus
  param.enable = true;
  param.enable_router_mode = false;
  param.max_trie_depth = static_cast<size_t>(max_trie_depth);
  param.min_bfs_breadth = static_cast<size_t>(min_bfs_breadth);
  param.max_bfs_breadth = static_cast<size_t>(max_bfs_breadth);
  param.draft_token_num = static_cast<size_t>(draft_token_num);
  param.match_type = match_type == 0 ? "BFS" : "PROB";
  return new Ngram(static_cast<size_t>(capacity), param);
}

void ngram_free(void* corpus) { delete static_cast<Ngram*>(corpus); }

// the worker's batch_put of one request's window, then the synchronize it does before the next match
void ngram_insert(void* corpus, const int32_t* tokens, int64_t length) {
  auto* ngram = static_cast<Ngram*>(corpus);
  std::vector<std::vector<int32_t>> batch{std::vector<int32_t>(tokens, tokens + length)};
  ngram->asyncInsert(std::move(batch));
  ngram->synchronize();
}

// batch_get for one request: its draft_token_num tokens and the draft_token_num x draft_token_num mask
void ngram_match(void* corpus, int64_t state_id, const int32_t* tokens, int64_t length, int64_t total_length,
                 int32_t* out_tokens, uint8_t* out_mask) {
  auto* ngram = static_cast<Ngram*>(corpus);
  auto result = ngram->batchMatch({state_id}, {std::vector<int32_t>(tokens, tokens + length)},
                                  {static_cast<size_t>(total_length)});
  std::memcpy(out_tokens, result.token.data(), result.token.size() * sizeof(int32_t));
  std::memcpy(out_mask, result.mask.data(), result.mask.size());
}
}
