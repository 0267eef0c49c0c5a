"""ByteTokenizer, HF tokenizer.json loading and chat templates."""

from __future__ import annotations

import pytest

from checkpoints import BOS_ID, EOS_IDS, make_hf_checkpoint
from tetris.model.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, render_default_chat


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer(512)
    text = "Grüße, 世界! <|eot_id|> done"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert 260 in ids and ids.count(260) == 1  # the special string became one id
    assert all(0 <= i < 512 for i in ids)
    # Specials are skipped on decode; text bytes come back exactly.
    assert tok.decode(ids) == "Grüße, 世界!  done"
    assert tok.encode("abc", add_bos=False) == [97, 98, 99]
    assert tok.eos_token_ids == (257, 260)


def test_byte_tokenizer_invalid_utf8_and_high_ids():
    tok = ByteTokenizer(512)
    # A lone continuation byte and a truncated 3-byte sequence; 400 is a non-byte, non-special id.
    assert tok.decode([104, 0x80, 105, 0xE4, 0xB8, 400]) == "h\ufffdi\ufffd"
    with pytest.raises(TokenizerError, match="vocab_size"):
        ByteTokenizer(200)


def test_default_chat_template_renders_llama3_style():
    text = render_default_chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
    ])
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = ByteTokenizer().encode(text)
    assert ids.count(258) == 3 and ids.count(260) == 2 and ids.count(256) == 1
    with pytest.raises(TokenizerError):
        render_default_chat([])
    with pytest.raises(TokenizerError, match="role"):
        render_default_chat([{"content": "x"}])


def test_hf_tokenizer_from_checkpoint(tmp_path):
    tok = HFTokenizer(make_hf_checkpoint(tmp_path))
    assert tok.bos_token_id == BOS_ID
    assert EOS_IDS[0] in tok.eos_token_ids
    text = "Hello wörld,  spaces\tand\nlines"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and len(ids) == 1 + len(text.encode())
    assert tok.decode(ids) == text
    # No template in tokenizer_config.json: the default one.
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == render_default_chat(chat)


def test_hf_tokenizer_renders_checkpoint_template(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = HFTokenizer(make_hf_checkpoint(tmp_path, chat_template=template))
    out = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    # Rendered without BOS: encode(add_bos=True) adds the single one.
    assert out == "[system]s\n[user]u\n[assistant]"


def test_hf_tokenizer_missing_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)
