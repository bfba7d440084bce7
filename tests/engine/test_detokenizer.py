import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qserve.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from qserve.engine.sampling_params import SamplingParams
from tests.tiny import EOS, byte_bpe_tokenizer

TEXTS = [
    "Call me Ishmael. Some years ago— never mind how long precisely—",
    "The whale 🐋 swam past 東京 and 北京; naïve Zürich café owners cheered 🎉👍🏽!",
    "Unseen: 鯨の歌 🦑🦀 Ελληνικά ÅÆØ ß…\nnew line\ttab “quoted” ½",
    "é" * 7 + "🐳" * 3 + "日本" * 2,
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_bpe_tokenizer()


def stream(tokenizer, prompt_ids, output_ids, params, stop_terminated_at_end=False):
    """Feed tokens one at a time; returns (detokenizer, deltas, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = []
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        stop = detok.update([token_id], stop_terminated=stop_terminated_at_end and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            return detok, deltas, stop
    return detok, deltas, None


def test_some_characters_are_split_over_tokens(tokenizer):
    # The streaming tests below only mean something if partial characters occur.
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(TEXTS[1] + TEXTS[2]))
    partial = [t for t in tokens if "\ufffd" in tokenizer.convert_tokens_to_string([t])]
    assert len(partial) >= 5


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Prompt with 🐋 at its end 🐋"])
def test_streamed_deltas_equal_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text)
    detok, deltas, stop = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_token_ids == ids


def test_update_with_several_tokens_per_step(tokenizer):
    ids = tokenizer.encode(TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for start in range(0, len(ids), 3):
        assert detok.update(ids[start : start + 3], stop_terminated=False) is None
    assert detok.get_next_output_text(finished=True, delta=False) == TEXTS[1]


def test_ids_past_the_tokenizer_decode_to_nothing(tokenizer):
    # A model's vocab may be padded past the tokenizer's (e.g. to a multiple of 64).
    ids = tokenizer.encode("Hi") + [len(tokenizer) + 3] + tokenizer.encode(" there")
    detok, deltas, _ = stream(tokenizer, [], ids, SamplingParams())
    assert "".join(deltas) == detok.output_text == "Hi there"
    assert detok.output_token_ids == ids


def test_special_tokens_skipped_or_kept(tokenizer):
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("Hello") + [eos_id] + tokenizer.encode(" world")
    _, deltas, _ = stream(tokenizer, [], ids, SamplingParams())
    assert "".join(deltas) == "Hello world"
    _, deltas, _ = stream(tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == f"Hello{EOS} world"


def test_stop_terminated_token_text_is_left_out(tokenizer):
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("The end") + [eos_id]
    params = SamplingParams(skip_special_tokens=False)
    detok, _, _ = stream(tokenizer, [], ids, params, stop_terminated_at_end=True)
    assert detok.output_text == "The end"
    assert detok.output_token_ids == ids
    with_stop = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok, _, _ = stream(tokenizer, [], ids, with_stop, stop_terminated_at_end=True)
    assert detok.output_text == f"The end{EOS}"


def _spanning_stop(tokenizer, text, stop):
    """Check that `stop` is spread over more than one token of `text`."""
    ids = tokenizer.encode(text)
    start = text.index(stop)
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    inside = [e for e in ends if start < e < start + len(stop)]
    assert inside, f"{stop!r} sits inside one token"
    return ids


def test_stop_string_spanning_tokens_truncates_and_is_never_streamed(tokenizer):
    text = "Call me Ishmael. Some years ago, never mind how long."
    ids = _spanning_stop(tokenizer, text, "Ishmael. Some")
    params = SamplingParams(stop=["Ishmael. Some", "zzz"])
    detok, deltas, stop = stream(tokenizer, [], ids, params)
    assert stop == "Ishmael. Some"
    assert detok.output_text == "Call me "
    assert "".join(deltas) == "Call me "
    # While streaming, the last len(stop) - 1 characters were withheld.
    streamed = ""
    for delta in deltas[:-1]:
        streamed += delta
        assert "Ishm" not in streamed
    assert detok.output_token_ids == ids[: len(detok.output_token_ids)]


def test_stop_string_with_multibyte_characters(tokenizer):
    text = "The whale 🐋 swam past 東京 and on."
    ids = _spanning_stop(tokenizer, text, "🐋 swam")
    detok, deltas, stop = stream(tokenizer, [], ids, SamplingParams(stop="🐋 swam"))
    assert (stop, detok.output_text, "".join(deltas)) == ("🐋 swam", "The whale ", "The whale ")
    assert all("\ufffd" not in d for d in deltas)


def test_include_stop_str_in_output(tokenizer):
    text = "Call me Ishmael. Some years ago, never mind how long."
    ids = tokenizer.encode(text)
    params = SamplingParams(stop="Ishmael.", include_stop_str_in_output=True)
    detok, deltas, stop = stream(tokenizer, [], ids, params)
    assert stop == "Ishmael."
    # Cut right after the stop string, even when the token that completed it carried more text.
    assert detok.output_text == "Call me Ishmael."
    assert "".join(deltas) == "Call me Ishmael."


def test_earliest_stop_string_wins_and_min_tokens_delays_stops(tokenizer):
    ids = tokenizer.encode("a b c d e f")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["e", "c", "b"]))
    assert detok.update(ids, stop_terminated=False) == "b"
    assert detok.output_text == "a "
    params = SamplingParams(stop=["b"], min_tokens=len(ids) - 1)
    detok, _, stop = stream(tokenizer, [], ids, params)
    assert stop is None and detok.output_text == "a b c d e f"


def test_get_next_output_text_withholds_the_stop_buffer(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    detok.update(tokenizer.encode("hello there"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "hello t"
    assert detok.get_next_output_text(finished=False, delta=True) == "hello t"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "here"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello there"


def test_check_stop_strings_only_searches_new_text():
    assert check_stop_strings("abcSTOPdef", 3, ["STOP"], False) is None
    assert check_stop_strings("abcSTOPdef", 4, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOP", 1, ["STOP"], True) == ("STOP", -1)
    assert check_stop_strings("abcSTOPd", 2, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abc", 0, ["c"], False) is None


def _smollm2_dir() -> Path:
    cache = Path(os.environ.get("QSERVE_CACHE_DIR", Path.home() / ".cache" / "qserve"))
    return cache / "models" / "smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(not (_smollm2_dir() / "tokenizer.json").exists(), reason="no SmolLM2 folder")
def test_smollm2_tokenizer_streams_exact_text():
    tokenizer = AutoTokenizer.from_pretrained(_smollm2_dir())
    prompt_ids = tokenizer.encode("Translate: ")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok, deltas, _ = stream(tokenizer, prompt_ids, ids, SamplingParams())
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas)
