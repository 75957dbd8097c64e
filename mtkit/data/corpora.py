"""The standard corpora mtkit can prepare: where each comes from. ``mtkit prepare --list`` prints it.

Multi30k is the official release's gzip text files by URL, with their SHA-256; a mirror (a directory, a
``file://`` or an ``http(s)://`` base) holds the same files under their names.

The Hub corpora (WMT14, WMT16, IWSLT17) are Hugging Face datasets, loaded through ``datasets`` as
``mtkit prepare hf:...`` loads any (mtkit.data.hf_corpus), so its cache, ``HF_HOME``, ``HF_TOKEN``, offline mode
and ``HF_ENDPOINT`` apply. WMT14 is pinned to a Hub commit, one not yet checked against the Hub (``--list``
says so; a revision the Hub does not have is one error line naming the corpus and the revision). WMT16
(``main``) and IWSLT17 (the Hub's
parquet conversion of a script dataset, the branch ``refs/convert/parquet``) name a branch; prepare.json, and
the report of ``mtkit run``, record the commit each resolved to. A mirror of a Hub corpus is a local
folder holding its repository under its id, as ``git clone`` lays it out (MIRROR/wmt/wmt14/README.md,
MIRROR/wmt/wmt14/de-en/*.parquet); it is loaded as that folder, with no revision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtkit.config import ConfigError
from mtkit.data.hf_corpus import HubCorpus

MULTI30K_RAW = "https://github.com/multi30k/dataset/raw/master/data/task1/raw"


@dataclass(frozen=True)
class RemoteFile:
    url: str
    sha256: str | None = None  # None where no copy was at hand to hash; the download is then unverified

    @property
    def filename(self) -> str:
        """Its name in the download folder and in a mirror: the URL's last part."""
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Split:
    """One split's text files: a gzip or plain text file per language, line-aligned, (source, target) order."""

    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class Corpus:
    name: str
    src_lang: str
    tgt_lang: str
    about: str  # what it is, and the standard test set it reports on
    splits: dict[str, Split] = field(default_factory=dict)  # train, valid, test as text files; none for a Hub corpus
    dataset: HubCorpus | None = None  # a Hub corpus: the dataset, config and revision it loads
    caveat: str | None = None  # what `mtkit prepare --list` must say of it, e.g. an unchecked pin

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
        return Split(files)

    return Corpus(
        f"multi30k_{src}_{tgt}",
        src,
        tgt,
        "Multi30k task 1 (Elliott et al., 2016): 29,000 image-caption pairs; test_2016_flickr",
        {"train": split("train"), "valid": split("val"), "test": split("test_2016_flickr")},
    )


def _hub(name: str, about: str, dataset: HubCorpus, caveat: str | None = None) -> Corpus:
    return Corpus(name, dataset.src_lang, dataset.tgt_lang, about, dataset=dataset, caveat=caveat)


def _wmt14_en_de(src: str, tgt: str) -> Corpus:
    return _hub(
        f"wmt14_{src}_{tgt}",
        "WMT14 English-German (Europarl v7, Common Crawl, News Commentary v9): 4.5M pairs; "
        "newstest2013 valid, newstest2014 test",
        # Meant as the commit of main, last modified 2024-04-03; written down without a look at the Hub.
        HubCorpus("wmt/wmt14", src, tgt, config="de-en", revision="b199e406369ec1b7634206d3ded5ba45de2fe696"),
        "revision not yet checked against the Hub",
    )


def _wmt16_en_ro(src: str, tgt: str) -> Corpus:
    return _hub(
        f"wmt16_{src}_{tgt}",
        "WMT16 English-Romanian (Europarl v8, SETIMES2): 610k pairs; newsdev2016 valid, newstest2016 test",
        HubCorpus("wmt/wmt16", src, tgt, config="ro-en", revision="main"),
    )


def _iwslt17_de_en(src: str, tgt: str) -> Corpus:
    # A script dataset, which datasets no longer runs; the Hub's parquet conversion of it keeps one folder per
    # language pair, and no dataset card.
    return _hub(
        f"iwslt17_{src}_{tgt}",
        "IWSLT 2017 German-English TED talks: 206k pairs; dev2010 valid, tst2010-2015 test",
        HubCorpus("IWSLT/iwslt2017", src, tgt, revision="refs/convert/parquet", data_dir="iwslt2017-de-en"),
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


def find_corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ConfigError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    return CORPORA[name]
