"""Corpus cleaning: what normalisation keeps and removes, which rule drops a pair, streaming, exact counts."""

from __future__ import annotations

import itertools
import random
from dataclasses import fields

import captions
import pytest

from mtkit.config import CleanConfig, ConfigError
from mtkit.data.clean import CleanSummary, SeenDigests, clean_pairs, normalize

DROPS = ("empty", "too_short", "too_long", "ratio", "duplicate")


def clean(pairs, **cfg) -> tuple[list[tuple[str, str]], CleanSummary]:
    summary = CleanSummary()
    return list(clean_pairs(pairs, CleanConfig(**cfg), summary)), summary


def adds_up(summary: CleanSummary) -> bool:
    return summary.read == summary.kept + sum(getattr(summary, name) for name in DROPS)


def test_control_characters_and_tabs_inside_lines():
    assert normalize("a\tb\x0bc\x0cd\re\x85f", nfkc=False) == "a b c d e f"  # whitespace controls become spaces
    assert normalize("ab\x00c\x1b\x7fd\x08e", nfkc=False) == "abcde"  # the others are deleted
    assert normalize("Ein\t\tHund \t rennt\n", nfkc=False) == "Ein Hund rennt"


def test_bom_soft_hyphen_and_other_format_characters_removed():
    assert normalize("\ufeffA dog runs.", nfkc=False) == "A dog runs."
    assert normalize("Donau\u00addampf\u00adschiff", nfkc=False) == "Donaudampfschiff"
    # Zero-width space, word joiner, left-to-right mark and a bidi embedding pair.
    assert normalize("a\u200bb\u2060c\u200ed\u202ae\u202c", nfkc=False) == "abcde"


def test_zwj_emoji_persian_zwnj_and_flag_tags_survive():
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # man ZWJ woman ZWJ girl
    technologist = "\U0001f469\u200d\U0001f4bb"
    persian = "می\u200cخواهم"  # "I want": the ZWNJ keeps the prefix unjoined
    england = "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f"
    arabic_number = "\u0600١٢٣"
    for text in (family, technologist, persian, england, arabic_number):
        assert normalize(text, nfkc=False) == text
        assert normalize(f" {text}\ufeff ", nfkc=True) == text


def test_nfkc_only_when_asked():
    assert normalize("ﬁnd ２０２４ Ｔｅｓｔ", nfkc=False) == "ﬁnd ２０２４ Ｔｅｓｔ"
    assert normalize("ﬁnd ２０２４ Ｔｅｓｔ", nfkc=True) == "find 2024 Test"
    # The soft hyphen goes first, so the acute accent it separated composes with the e.
    assert normalize("Cafe\u00ad\u0301", nfkc=True) == "Caf\u00e9"


def test_whitespace_runs_collapsed_and_stripped():
    assert normalize("  Ein   Hund\u00a0\u00a0läuft\u3000schnell \u2028 ", nfkc=False) == "Ein Hund läuft schnell"
    assert normalize(" \t\u00a0\ufeff ", nfkc=False) == ""


def test_pairs_differing_only_in_spacing_are_duplicates():
    pairs = [
        ("A dog runs.", "Ein Hund rennt."),
        ("A  dog runs. ", "Ein\u00a0Hund\trennt."),
        ("\ufeffA dog runs.", "Ein Hund rennt."),
        ("A dog runs.", "Ein Hund läuft."),  # another translation of the same source is not a duplicate
    ]
    kept, summary = clean(pairs)
    assert kept == [("A dog runs.", "Ein Hund rennt."), ("A dog runs.", "Ein Hund läuft.")]
    assert (summary.duplicate, summary.changed) == (2, 3)
    kept, summary = clean(pairs, dedupe=False)
    assert len(kept) == 4 and summary.duplicate == 0


def test_nfkc_makes_more_duplicates():
    pairs = [("ﬁsh", "Fisch"), ("fish", "Fisch")]
    assert clean(pairs)[1].duplicate == 0
    assert clean(pairs, nfkc=True)[1].duplicate == 1


@pytest.mark.parametrize(
    "pair, rule",
    [
        (("", "Ein Hund."), "empty"),
        (("A dog.", " \t\ufeff"), "empty"),
        (("A dog.", "Hund"), "too_short"),  # min_words=2; too short comes before the ratio (2 / 1 is fine anyway)
        (("one " * 11, "eins " * 11), "too_long"),  # max_words=10
        (("one " * 11, "eins"), "too_short"),  # too short and too long and a bad ratio: the first rule counts
        (("one two three four five six seven", "eins zwei"), "ratio"),  # 7 / 2 > 3
        (("one two three four five six", "eins zwei"), "kept"),  # 6 / 2 == 3 is allowed
        (("A dog runs.", "Ein Hund rennt."), "duplicate"),  # seen first below
    ],
)
def test_each_pair_counted_under_the_first_rule_that_drops_it(pair, rule):
    first = ("A dog runs.", "Ein Hund rennt.")
    kept, summary = clean([first, pair], min_words=2, max_words=10)
    counts = summary.to_dict()
    assert counts["read"] == 2 and adds_up(summary)
    for name in (*DROPS, "kept"):
        assert counts[name] == (name == rule) + (name == "kept"), name


def test_order_preserved():
    pairs = [(f"sentence {i}", f"Satz {i}") for i in range(50)]
    pairs[10] = ("", "leer")
    kept, _ = clean(pairs)
    assert kept == pairs[:10] + pairs[11:]


def test_consumes_an_endless_generator_lazily():
    pulled = 0

    def endless():
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield (f"pair {i}", "" if i % 3 == 0 else f"Paar {i}")

    summary = CleanSummary()
    first = list(itertools.islice(clean_pairs(endless(), CleanConfig(), summary), 10))
    assert first[0] == ("pair 1", "Paar 1") and len(first) == 10
    assert pulled == summary.read == 15  # 10 kept, 5 empty, nothing read ahead
    assert (summary.kept, summary.empty) == (10, 5)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"min_words": 0}, "clean.min_words must be >= 1"),
        ({"min_words": 5, "max_words": 4}, "clean.max_words must be >= clean.min_words"),
        ({"max_ratio": 0.5}, "clean.max_ratio must be >= 1"),
        ({"max_ratio": float("nan")}, "clean.max_ratio must be >= 1"),
    ],
)
def test_config_rejects_bad_values_in_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as error:
        CleanConfig(**values)
    assert "\n" not in str(error.value)


def test_summary_line_and_dict():
    summary = CleanSummary(read=29000, kept=28990, empty=3, too_long=4, ratio=3, changed=12)
    assert summary.line() == (
        "read 29,000 pairs, kept 28,990; dropped 3 empty, 0 too short, 4 too long, 3 by length ratio, "
        "0 duplicates; 12 lines normalised"
    )
    assert list(summary.to_dict()) == [f.name for f in fields(CleanSummary)]
    assert summary.to_dict()["kept"] == 28990


def test_a_corpus_with_known_defects_gives_exact_counts_and_reproduces():
    text = captions.parallel(3_000, seed=5)
    published = list(zip(text["en"], text["de"]))
    pairs = list(published)
    # What scraped corpora hold: spacing to normalise, repeated pairs, a side that is not text, an empty side,
    # a line far too long.
    pairs[10] = (pairs[10][0] + "  ", pairs[10][1].replace(" ", "\u00a0", 1))
    pairs[20] = (pairs[20][0].replace(" ", "\t", 1), pairs[20][1])
    pairs += [
        pairs[5],
        pairs[6],
        (pairs[7][0], "@@"),
        ("", pairs[8][1]),
        (" ".join(["word"] * 300), " ".join(["Wort"] * 300)),
    ]

    def run(**cfg) -> tuple[list[tuple[str, str]], CleanSummary]:
        return clean(iter(pairs), **cfg)

    kept, summary = run()
    assert summary.to_dict() == {
        "read": 3005,
        "kept": 3000,
        "empty": 1,
        "too_short": 0,
        "too_long": 1,
        "ratio": 1,
        "duplicate": 2,
        "changed": 3,
    }
    assert kept == published  # normalised back to the captions as written, in their order
    assert all(normalize(side, nfkc=False) == side for pair in kept for side in pair)  # nothing left to do

    again, summary_again = run()
    assert again == kept and summary_again == summary
    strict = run(max_ratio=1.2)[1]  # fairseq's examples use 1.5: English captions run longer than German ones
    assert strict.ratio > summary.ratio and strict.kept < summary.kept and adds_up(strict)


def test_seen_digests_answer_like_a_set_across_spills():
    """The compact dedupe set (its memory is measured by benchmarks/bench_wmt_scale.py) never errs either way."""
    rng = random.Random(7)
    pool = [rng.getrandbits(64) for _ in range(3_000)] + [0, 1, 2**48 - 1, 2**48, 2**63, 2**64 - 1]
    seen, reference = SeenDigests(spill=100), set()
    for digest in (rng.choice(pool) for _ in range(20_000)):
        assert seen.add(digest) == (digest not in reference)
        reference.add(digest)
    assert len(seen) == len(reference) and len(seen.older) > 2_500  # most digests went through a spill
