#!/usr/bin/env python3
"""Expected tokenizer outputs from independent implementations, committed as test fixtures.

- tests/data/pretokenizer_splits.json: each pre-tokenizer's regexes run by the `tokenizers`
  package (Oniguruma regexes, `Split(..., behavior="isolated")` in sequence, which is how
  llama.cpp applies a list of regexes) over a set of edge-case strings.
- tests/data/smollm2_ids.json: SmolLM2's vocabulary and merges read from its GGUF file with the
  `gguf` package and loaded into a `tokenizers` BPE with SmolLM2's pre-tokenizer (digits alone,
  then GPT-2 byte-level words).
- tests/data/gemma3_ids.json: Gemma 3's pieces, scores and types loaded into a SentencePiece BPE
  model (the `sentencepiece` package) with byte fallback and no dummy prefix.

Needs: pip install gguf tokenizers sentencepiece protobuf. Models: scripts/fetch-model.sh.
Run: python3 tools/gen_tokenizer_fixtures.py [MODEL_DIR]
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEER = os.path.join(ROOT, "..", "shared", "peer", "tokenizer")

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-4o's (o200k) regex as its tokenizer.json has it: Oniguruma's own \p{Lu}/\p{Ll} and (?i:).
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", GPT2],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
    "gpt-4o": [GPT4O],
}

EXTRA = [
    "Hello world", " Hello  world ", "I'M here, we'Ve SEEN it'S", "don't you'll 'd 'x", "1234567 89 0",
    "3.14159 and 1,000,000", "a\u00a0b\u3000c\u2003d", "line1\nline2\r\nline3\n\n\n  indented\n\t\ttabs",
    "   \n  \n", "trailing   ", "\n", "café naïve résumé", "日本語のテキスト、です。", "emoji 🦙🚀 done",
    "مرحبا ١٢٣ عالم", "x = a+b<=c^d~e|f`g$h", "def f(x):\n    return x**2  # square\n", "((( ))) --- ...",
    "Ünïcödé ÀÉÎ ß", "tab\tseparated\tvalues", "\u0301combining e\u0301", "a' b '' c'", "§¶•‣",
    "The year 2024 had 365 days.", "What is the capital of France?", "<|im_start|>user\nhi<|im_end|>",
    # letter case (GPT-4o splits words where lower case turns upper), titlecase, modifiers, marks
    "HelloWorld CamelCaseXMLParser iPhone getHTTPResponse", "ÉCOLE École STRAßE ǅemal ǈubljana",
    "don'T WE'LL HE'S it'ſ x'Re", "ʰmodifier ˢup ΑΒΓ αβγ Άλφα ДОМ дом", "e\u0301\u0302X \u0301A \u0301a 1\u0301",
    "path/to/file\n", "a/b\r\n/c //\n", "_under_score __init__ ++i -x", "12345 1234567890 ١٢٣٤",
]


def inputs():
    text = open(os.path.join(PEER, "ggml-vocab-gpt-2.gguf.inp"), encoding="utf-8").read()
    parts = text.split("\n__ggml_vocab_test__\n")[:-1]
    return parts + EXTRA


def splits(strings):
    out = {}
    for name, regexes in PRE.items():
        seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])
        out[name] = [[p for p, _ in seq.pre_tokenize_str(s)] for s in strings]
    return out


def read_vocab(path):
    from gguf import GGUFReader
    r = GGUFReader(path)
    f = r.fields
    get = lambda k: f[k].contents() if k in f else None
    return get("tokenizer.ggml.tokens"), get("tokenizer.ggml.scores"), get("tokenizer.ggml.token_type"), \
        get("tokenizer.ggml.merges")


def smollm2_ids(path, strings):
    tokens, _, _, merges = read_vocab(path)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return [tok.encode(s, add_special_tokens=False).ids for s in strings]


def gemma3_ids(path, strings):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    tokens, scores, types, _ = read_vocab(path)
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = tokens.index("<unk>")
    m.trainer_spec.bos_id = tokens.index("<bos>")
    m.trainer_spec.eos_id = tokens.index("<eos>")
    m.trainer_spec.pad_id = tokens.index("<pad>")
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for t, s, ty in zip(tokens, scores, types):
        p = m.pieces.add()
        # The GGUF converter wrote user-defined pieces with plain spaces; SentencePiece matches them
        # in the escaped text.
        p.piece = t.replace(" ", "\u2581") if ty == 4 else t
        p.score = s
        p.type = ty
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return [sp.encode(s) for s in strings]


def dump(name, obj):
    with open(os.path.join(ROOT, "tests", "data", name), "w") as f:
        json.dump(obj, f, ensure_ascii=True, indent=0)
    print("wrote tests/data/" + name)


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/baton/models")
    strings = inputs()
    dump("pretokenizer_splits.json", {"inputs": strings, "splits": splits(strings)})
    # Real-model strings: no special-token text (the reference treats it differently on purpose).
    real = [s for s in strings if "<|" not in s and s]
    dump("smollm2_ids.json", {"inputs": real, "ids": smollm2_ids(
        os.path.join(model_dir, "SmolLM2-135M-Instruct.Q4_1.gguf"), real)})
    dump("gemma3_ids.json", {"inputs": real, "ids": gemma3_ids(
        os.path.join(model_dir, "gemma-3-270m-q4_k_m.gguf"), real)})


if __name__ == "__main__":
    main()
