"""The `byte` and `hf` tokenizer plugins: round trips, special tokens, and errors a user can act on."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanocore.data.api import Tokenizer as TokenizerProtocol
from nanocore.errors import DataError
from nanocore.plugins import load_plugins
from nanocore_plugins.tokenizers import plugin as tokenizer_plugin
from nanocore_plugins.tokenizers.byte import ByteTokenizer
from nanocore_plugins.tokenizers.hf import load_hf_tokenizer

CORPUS = ["hello world", "the quick brown fox", "jumps over the lazy dog", "héllo wörld 漢字"] * 5


def train_bpe(folder, special=("<|endoftext|>", "<s>")):
    """A tiny byte-level BPE written as tokenizer.json in `folder`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


@pytest.fixture
def registry():
    plugins = load_plugins(entry_points=False)
    plugins.register_object(tokenizer_plugin, "tokenizers")
    return plugins.registries.tokenizer


def test_byte_round_trip_and_special_ids(registry):
    tok = registry.get("byte").factory("byte")
    assert isinstance(tok, TokenizerProtocol)
    assert (tok.vocab_size, tok.eos_token_id, tok.bos_token_id) == (257, 256, None)
    text = "Hello, wörld! 漢字 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text


def test_byte_decode_skips_eos_and_replaces_broken_utf8():
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 256, 33]) == "hi!"
    # a lone continuation byte (as a model may sample) decodes to U+FFFD instead of raising
    assert tok.decode([104, 0x80, 105]) == "h\ufffdi"


def test_hf_folder_round_trip_with_special_tokens_from_config(tmp_path, registry):
    folder = tmp_path / "tok"
    raw = train_bpe(folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}, "model_max_length": 64})
    )
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<s>"}))
    tok = registry.get("hf").factory(str(folder))
    assert isinstance(tok, TokenizerProtocol)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    # tokenizer_config.json wins over special_tokens_map.json; the map fills what the config lacks
    assert tok.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_token_id == raw.token_to_id("<s>")
    for text in ["the lazy fox", "héllo 漢字 world", "unseen zebra words"]:
        ids = tok.encode(text)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("hello"), tok.eos_token_id]) == "hello"


def test_hf_bare_tokenizer_json_file_guesses_eos(tmp_path):
    raw = train_bpe(tmp_path / "bare", special=("<|endoftext|>",))
    tok = load_hf_tokenizer(str(tmp_path / "bare" / "tokenizer.json"))
    assert tok.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None


def test_hf_hub_name_is_refused_with_instructions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        load_hf_tokenizer("meta-llama/Llama-3.2-1B")
    message = str(err.value)
    assert "local files only" in message and "huggingface-cli download meta-llama/Llama-3.2-1B" in message


def test_hf_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "vocab.json").write_text("{}")
    with pytest.raises(DataError, match="has no tokenizer.json.*save_pretrained"):
        load_hf_tokenizer(str(tmp_path / "slow"))


def test_hf_config_naming_a_token_not_in_the_vocabulary(tmp_path):
    train_bpe(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError, match="'</s>'.*not in tokenizer.json's vocabulary"):
        load_hf_tokenizer(str(tmp_path / "tok"))
