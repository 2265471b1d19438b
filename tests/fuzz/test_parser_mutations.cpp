// Every parser of outside input keeps its contract on inputs a few edits away from valid ones: it
// accepts or throws lmoe::Error, nothing else (and, in the cpu-sanitize build, touches no memory it
// does not own). Deterministic: the edits come from a fixed seed, so a failure reproduces exactly.
// Coverage-guided fuzzing of the same targets is scripts/fuzz.sh (clang's libFuzzer).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "core/fast_random.hpp"
#include "fuzz/parser_targets.hpp"

namespace {

using lmoe_fuzz::Bytes;
using lmoe_fuzz::ParserTarget;
using nlohmann::json;

constexpr int kByteEdits = 5000;        // per target, spread over its seeds
constexpr int kStructuralEdits = 5000;  // per JSON target

class Edits {
 public:
  explicit Edits(std::uint64_t seed) : random_{seed} {}

  std::size_t below(std::size_t n) {
    return n == 0 ? 0 : static_cast<std::size_t>(random_.next() % n);
  }

  // One to four byte-level edits: flip a bit, write a byte that matters to JSON or to a length,
  // cut, repeat or drop a run, cut the tail.
  Bytes bytes(Bytes input) {
    static constexpr char kInteresting[] = "\"{}[],:-+.0123456789eE\\ntfu \x00\xff\x7f\x80";
    for (std::size_t n = 1 + below(4); n > 0; --n) {
      const std::size_t at = below(input.size() + 1);
      switch (below(6)) {
        case 0:
          if (at < input.size()) input[at] ^= static_cast<std::byte>(1u << below(8));
          break;
        case 1:
          if (at < input.size())
            input[at] = static_cast<std::byte>(kInteresting[below(sizeof kInteresting - 1)]);
          break;
        case 2: {  // drop a run
          const std::size_t count = std::min(input.size() - at, 1 + below(16));
          input.erase(input.begin() + static_cast<std::ptrdiff_t>(at),
                      input.begin() + static_cast<std::ptrdiff_t>(at + count));
          break;
        }
        case 3: {  // repeat a run
          const std::size_t count = std::min(input.size() - at, 1 + below(16));
          const Bytes run(input.begin() + static_cast<std::ptrdiff_t>(at),
                          input.begin() + static_cast<std::ptrdiff_t>(at + count));
          input.insert(input.begin() + static_cast<std::ptrdiff_t>(at), run.begin(), run.end());
          break;
        }
        case 4: input.resize(at); break;
        default:  // a byte of any value
          input.insert(input.begin() + static_cast<std::ptrdiff_t>(at),
                       static_cast<std::byte>(below(256)));
          break;
      }
    }
    return input;
  }

  // One node of the document replaced by a value of another kind or an extreme of its own, or
  // removed: what a hand-edited or truncated table, or one from another version, looks like.
  json structural(json document) {
    std::vector<json*> nodes;
    collect(document, nodes);
    json* node = nodes[below(nodes.size())];
    const json replacements[] = {nullptr,
                                 true,
                                 false,
                                 0,
                                 -1,
                                 1,
                                 2,
                                 3,
                                 4,
                                 257,
                                 -9223372036854775807LL - 1,
                                 18446744073709551615ULL,
                                 0.5,
                                 -0.0,
                                 1e308,
                                 -1e308,
                                 1e-320,
                                 "",
                                 "fused",
                                 "column",
                                 "x",
                                 json::array(),
                                 json::array({1, 2}),
                                 json::object(),
                                 json::object({{"tier", "fused"}})};
    const std::size_t pick = below(std::size(replacements) + 2);
    if (pick < std::size(replacements)) {
      *node = replacements[pick];
    } else if (node->is_object() && !node->empty()) {  // drop a key
      auto it = node->begin();
      std::advance(it, static_cast<std::ptrdiff_t>(below(node->size())));
      node->erase(it.key());
    } else if (node->is_array() && !node->empty()) {  // drop or repeat an element
      const std::size_t at = below(node->size());
      if (pick == std::size(replacements)) {
        node->erase(at);
      } else {
        node->push_back((*node)[at]);
      }
    }
    return document;
  }

 private:
  static void collect(json& node, std::vector<json*>& nodes) {
    nodes.push_back(&node);
    if (node.is_structured()) {
      for (json& child : node) collect(child, nodes);
    }
  }

  lmoe::SplitMix64 random_;
};

// The input's first bytes, printable ones as they are and the others as \xHH.
std::string shown(const Bytes& input) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text;
  std::size_t i = 0;
  for (; i < input.size() && text.size() < 400; ++i) {
    const auto c = static_cast<unsigned char>(input[i]);
    if (c >= 0x20 && c < 0x7f) {
      text += static_cast<char>(c);
    } else {
      text += {'\\', 'x', kHex[c >> 4], kHex[c & 15]};
    }
  }
  return i < input.size() ? text + "…" : text;
}

// Runs the target on one input; a failure names the edit that made the input.
struct Tally {
  int accepted = 0;
  int refused = 0;
};

void run_one(const ParserTarget& target, const Bytes& input, const std::string& edit,
             Tally& tally) {
  try {
    (target.parse(input) ? tally.accepted : tally.refused) += 1;
  } catch (const std::exception& error) {
    ADD_FAILURE() << target.what << " threw " << typeid(error).name() << " (not lmoe::Error) on "
                  << edit << ": " << error.what() << "\ninput (" << input.size()
                  << " bytes): " << shown(input);
  }
}

class ParserMutations : public ::testing::TestWithParam<std::string_view> {
 protected:
  const ParserTarget& target() const { return lmoe_fuzz::parser_target(GetParam()); }
  std::vector<Bytes> seeds() const { return lmoe_fuzz::parser_seeds(target(), LMOE_TEST_DATA_DIR); }
};

TEST_P(ParserMutations, SeedsAreAccepted) {
  const std::vector<Bytes> all = seeds();
  ASSERT_FALSE(all.empty());
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(target().parse(all[i]))
        << target().what << " refused seed " << i << ": " << shown(all[i]);
  }
}

TEST_P(ParserMutations, ByteEditsAreAcceptedOrRefusedWithLmoeError) {
  const std::vector<Bytes> all = seeds();
  Edits edits(0x5eed0000 + GetParam().size());
  Tally tally;
  for (int i = 0; i < kByteEdits && !HasFailure(); ++i) {
    const std::size_t s = static_cast<std::size_t>(i) % all.size();
    run_one(target(), edits.bytes(all[s]),
            "byte edit " + std::to_string(i) + " of seed " + std::to_string(s), tally);
  }
  // The edits reach both outcomes, so the parser's checks ran and so did what follows them.
  EXPECT_GT(tally.refused, 0);
  EXPECT_GT(tally.accepted + tally.refused, kByteEdits / 2);
}

// The targets that read JSON, edited as documents.
class JsonParserMutations : public ParserMutations {};

TEST_P(JsonParserMutations, StructuralEditsAreAcceptedOrRefusedWithLmoeError) {
  ASSERT_TRUE(target().json);
  std::vector<json> documents;
  for (const Bytes& seed : seeds()) documents.push_back(json::parse(seed.begin(), seed.end()));
  Edits edits(0xd0c0000 + GetParam().size());
  Tally tally;
  for (int i = 0; i < kStructuralEdits && !HasFailure(); ++i) {
    const std::size_t s = static_cast<std::size_t>(i) % documents.size();
    json edited = edits.structural(documents[s]);
    if (edits.below(4) == 0) edited = edits.structural(std::move(edited));  // sometimes two edits
    run_one(target(), lmoe_fuzz::to_bytes(edited.dump()),
            "structural edit " + std::to_string(i) + " of seed " + std::to_string(s), tally);
  }
  EXPECT_GT(tally.accepted, 0);
  EXPECT_GT(tally.refused, 0);
}

std::vector<std::string_view> target_names(bool json_only) {
  std::vector<std::string_view> names;
  for (const ParserTarget& target : lmoe_fuzz::parser_targets()) {
    if (target.json || !json_only) names.push_back(target.name);
  }
  return names;
}

const auto kName = [](const auto& info) { return std::string(info.param); };
INSTANTIATE_TEST_SUITE_P(Targets, ParserMutations, ::testing::ValuesIn(target_names(false)), kName);
INSTANTIATE_TEST_SUITE_P(Targets, JsonParserMutations, ::testing::ValuesIn(target_names(true)),
                         kName);

}  // namespace
