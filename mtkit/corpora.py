"""The standard corpora mtkit can prepare: where each split comes from and in what form.

Each corpus names its files by URL (the official release, or the Hugging Face Hub copy where that
is the maintained one) and, where mtkit could hash a copy, their SHA-256. A mirror (a directory, a
``file://`` or an ``http(s)://`` base) replaces the network: it holds the same files under their
``name``. ``mtkit prepare --list`` prints this catalogue.

The Hub corpora load through ``datasets`` as well (``mtkit prepare hf:wmt/wmt14 --config de-en``, see
mtkit.hf_corpus); the catalogue keeps fetching their parquet files by URL, so that ``--mirror`` and the
resumable, size-checked downloads apply to them as to Multi30k.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtkit.config import ConfigError

MULTI30K_RAW = "https://github.com/multi30k/dataset/raw/master/data/task1/raw"
HF = "https://huggingface.co/datasets"


@dataclass(frozen=True)
class RemoteFile:
    url: str
    sha256: str | None = None  # None where no copy was at hand to hash; the download is then unverified
    name: str = ""  # file name in the download folder and in a mirror; default: the URL's last part

    @property
    def filename(self) -> str:
        return self.name or self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Split:
    """One split's files. ``text``: a gzip or plain text file per language, line-aligned, ``files`` in
    (source, target) order. ``parquet``: rows {"translation": {lang: text, ...}}, in any number of files."""

    files: tuple[RemoteFile, ...]
    form: str  # "text" or "parquet"


@dataclass(frozen=True)
class Corpus:
    name: str
    src_lang: str
    tgt_lang: str
    splits: dict[str, Split]  # train, valid, test
    about: str  # what it is, and the standard test set it reports on

    @property
    def langs(self) -> tuple[str, str]:
        return self.src_lang, self.tgt_lang


# SHA-256 of the Multi30k task 1 raw files (the multi30k/dataset repository's data/task1/raw).
_MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
}


def _multi30k(src: str, tgt: str) -> Corpus:
    def split(prefix: str) -> Split:
        files = tuple(
            RemoteFile(f"{MULTI30K_RAW}/{prefix}.{lang}.gz", _MULTI30K_SHA256[f"{prefix}.{lang}.gz"])
            for lang in (src, tgt)
        )
        return Split(files, "text")

    return Corpus(
        f"multi30k_{src}_{tgt}",
        src,
        tgt,
        {"train": split("train"), "valid": split("val"), "test": split("test_2016_flickr")},
        "Multi30k task 1 (Elliott et al., 2016): 29,000 image-caption pairs; test_2016_flickr",
    )


def _hub(repo: str, revision: str, parts: dict[str, list[str]], prefix: str = "") -> dict[str, Split]:
    """Parquet splits of a Hugging Face Hub dataset; ``prefix`` keeps mirror names apart where the
    Hub's own file names repeat across splits."""
    return {
        split: Split(
            tuple(
                RemoteFile(
                    f"{HF}/{repo}/resolve/{revision}/{path}",
                    name=f"{prefix}{split}-{path.rsplit('/', 1)[-1]}" if prefix else "",
                )
                for path in paths
            ),
            "parquet",
        )
        for split, paths in parts.items()
    }


def _wmt14_en_de(src: str, tgt: str) -> Corpus:
    parts = {
        "train": [f"de-en/train-0000{i}-of-00003.parquet" for i in range(3)],
        "valid": ["de-en/validation-00000-of-00001.parquet"],
        "test": ["de-en/test-00000-of-00001.parquet"],
    }
    return Corpus(
        f"wmt14_{src}_{tgt}",
        src,
        tgt,
        _hub("wmt/wmt14", "main", parts),
        "WMT14 English-German (Europarl v7, Common Crawl, News Commentary v9): 4.5M pairs; "
        "newstest2013 valid, newstest2014 test",
    )


def _wmt16_en_ro(src: str, tgt: str) -> Corpus:
    parts = {
        "train": ["ro-en/train-00000-of-00001.parquet"],
        "valid": ["ro-en/validation-00000-of-00001.parquet"],
        "test": ["ro-en/test-00000-of-00001.parquet"],
    }
    return Corpus(
        f"wmt16_{src}_{tgt}",
        src,
        tgt,
        _hub("wmt/wmt16", "main", parts),
        "WMT16 English-Romanian (Europarl v8, SETIMES2): 610k pairs; newsdev2016 valid, newstest2016 test",
    )


def _iwslt17_de_en(src: str, tgt: str) -> Corpus:
    parts = {split: [f"iwslt2017-de-en/{split}/0000.parquet"] for split in ("train", "validation", "test")}
    parts["valid"] = parts.pop("validation")
    return Corpus(
        f"iwslt17_{src}_{tgt}",
        src,
        tgt,
        _hub("IWSLT/iwslt2017", "refs%2Fconvert%2Fparquet", parts, prefix="iwslt2017-de-en-"),
        "IWSLT 2017 German-English TED talks: 206k pairs; dev2010 valid, tst2010-2015 test",
    )


def _catalogue() -> dict[str, Corpus]:
    corpora = []
    for other in ("de", "fr", "cs"):
        corpora += [_multi30k("en", other), _multi30k(other, "en")]
    corpora += [_wmt14_en_de("en", "de"), _wmt14_en_de("de", "en")]
    corpora += [_wmt16_en_ro("en", "ro"), _wmt16_en_ro("ro", "en")]
    corpora += [_iwslt17_de_en("de", "en"), _iwslt17_de_en("en", "de")]
    return {c.name: c for c in corpora}


CORPORA = _catalogue()


def corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ConfigError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    return CORPORA[name]
