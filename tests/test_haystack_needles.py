import random

import pytest

from niah.data.haystack import NOISE, haystack_text, split_sentences, tokenize_haystack
from niah.data.needles import INTRO, NeedleSpec, make_trial, needle_text
from niah.data.prompts import build_cell
from niah.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_sentences_keep_their_leading_space_and_cjk_splits():
    assert split_sentences("A b. C d! E") == ["A b.", " C d!", " E"]
    assert split_sentences("第一句。第二句！") == ["第一句。", "第二句！"]


def test_haystack_sources_and_errors(tmp_path):
    assert len(haystack_text("pydoc")) > 400_000
    assert haystack_text("noise").startswith(NOISE)
    (tmp_path / "a.txt").write_text("中文的句子。还有一句。", encoding="utf-8")
    assert "中文" in haystack_text("folder", tmp_path)
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        haystack_text("folder", tmp_path)
    with pytest.raises(ValueError, match="unknown haystack"):
        haystack_text("wiki")


def test_short_haystack_repeats_with_a_warning():
    with pytest.warns(UserWarning, match="repeated"):
        hay = tokenize_haystack("One. Two.", TOK, 100)
    assert len(hay.ids) >= 100


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_lands_at_a_sentence_start_near_the_depth(depth):
    hay = tokenize_haystack(haystack_text("pydoc"), TOK, 3000)
    trial = make_trial(NeedleSpec(), random.Random(0))
    cell = build_cell(TOK, hay, 2000, depth, trial, "completion")
    assert len(cell.prefill_ids) == 2000
    needle = TOK.encode(needle_text("number", *trial.needles[0]), add_special_tokens=False)
    at = cell.needle_at
    assert cell.prefill_ids[at : at + len(needle)] == needle
    body_start = len(TOK.encode(INTRO.format(nouns="special magic numbers"), add_special_tokens=False))
    assert cell.prefill_ids[body_start : body_start + 5] == hay.ids[:5] or at == body_start
    hay_pos = at - body_start
    assert hay_pos in hay.starts  # a sentence boundary of the haystack
    n_hay = 2000 - body_start - len(needle)
    gaps = sorted(abs(s - depth * n_hay) for s in hay.starts if s < n_hay)
    assert abs(hay_pos - depth * n_hay) == gaps[0]  # the nearest boundary
    assert TOK.bos_token_id not in cell.prefill_ids + cell.question_ids + cell.answer_ids


def test_trials_are_seeded_and_variants_expect_the_right_values():
    a = make_trial(NeedleSpec(), random.Random("s/1"))
    assert a == make_trial(NeedleSpec(), random.Random("s/1"))
    assert len(a.expected[0]) == 7 and a.expected[0].isdigit()
    mk = make_trial(NeedleSpec(variant="multi_key", count=4), random.Random(1))
    assert len(mk.needles) == 4 and mk.expected == [mk.needles[0][1]] and len({k for k, _ in mk.needles}) == 4
    mv = make_trial(NeedleSpec(variant="multi_value", count=3), random.Random(1))
    assert len({k for k, _ in mv.needles}) == 1 and len(mv.expected) == 3
    mq = make_trial(NeedleSpec(variant="multi_query", count=2, kind="uuid"), random.Random(1))
    assert len(mq.queried_keys) == 2 and len(mq.expected[0]) == 36
    assert make_trial(NeedleSpec(kind="percent"), random.Random(1)).expected[0].endswith("%")
    with pytest.raises(ValueError, match="unknown needle kind"):
        NeedleSpec(kind="date")


def test_multi_needle_context_holds_every_needle():
    hay = tokenize_haystack(haystack_text("pydoc"), TOK, 3000)
    trial = make_trial(NeedleSpec(variant="multi_key", count=3), random.Random(2))
    cell = build_cell(TOK, hay, 2500, 0.5, trial, "completion")
    text = TOK.decode(cell.prefill_ids)
    assert all(needle_text("number", k, v) in text for k, v in trial.needles)
    assert len(cell.prefill_ids) == 2500
    assert cell.shared_prefix <= cell.needle_at


def test_chat_style_needs_a_chat_template():
    hay = tokenize_haystack(haystack_text("noise"), TOK, 500)
    with pytest.raises(ValueError, match="chat template"):
        build_cell(TOK, hay, 300, 0.5, make_trial(NeedleSpec(), random.Random(0)), "chat")


def test_sentences_come_one_at_a_time_and_a_text_without_tokens_is_refused():
    from niah.data.haystack import iter_sentences

    pieces = iter_sentences("One. Two! " + "x" * 10_000_000)
    assert next(pieces) == "One." and next(pieces) == " Two!"  # a generator: the rest of the text is not split
    assert split_sentences(haystack_text("pydoc")[:5000]) == list(iter_sentences(haystack_text("pydoc")[:5000]))

    class Silent:
        def encode(self, text, add_special_tokens=False):
            return []

    with pytest.raises(ValueError, match="no tokens"):
        tokenize_haystack("Some text.", Silent(), 10)
