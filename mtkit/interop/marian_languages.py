"""The languages an imported Marian model translates, recorded as a trained model's are.

They are given to the import, or read from an OPUS-MT name (``opus-mt-en-de``). A name's ``mul`` or
language-group code states no language, nor does the name of a model whose vocabulary holds target
tags (``>>por<<``) state its target: such a model translates into the language a tag at the start of
the input names, and the import tells the user so (``tags_note``).
"""

from __future__ import annotations

import re

from mtkit import untrusted
from mtkit.config import LANGUAGE_CODE, DataConfig
from mtkit.hub_folders import ModelImportError

# An OPUS-MT model's name states its languages: opus-mt-en-de, opus-mt-tc-big-en-pt (ISO 639 codes, or a group's)
_OPUS_NAME = re.compile(r"opus-mt-(?:tc-(?:big|base)-)?([a-z]{2,3})-([a-z]{2,3})")
# Codes of OPUS-MT names that are no language: mul (many) and the ISO 639-5 codes of language groups (zle, East
# Slavic; gem, Germanic; ...). A model into one of them chooses its target by a >>xxx<< tag.
GROUP_CODES = frozenset(
    "mul aav afa alg alv apa aqa aql art ath auf aus awd azc bad bai bat ber bih bnt btk cai cau cba ccn ccs cdc "
    "cdd cel cmc cpe cpf cpp crp csu cus day dmn dra egx esx euq fiu fox gem gme gmq gmw grk hmx hok hyx iir ijo inc "
    "ine ira iro itc jpx kar kdo khi kro map mkh mno mun myn nah nai ngf nic nub omq omv oto paa phi plf poz pqe pqw "
    "pra qwe roa sai sal sdv sem sgn sio sit sla smi son sqj ssa syd tai tbq trk tup tut tuw urj wak wen wns ypk zhx "
    "zle zls zlw znd".split()
)


def languages(origin: str, src_lang: str | None, tgt_lang: str | None, tags: list[str]) -> tuple[str, str]:
    """The languages to record: those given, else those an OPUS-MT name states (``origin`` is the folder's name or
    the Hub id), else mtkit's defaults ``src`` and ``tgt``, for both sides when neither is given. A name's code
    that is mul or a group's (``GROUP_CODES``) states no language, nor does its target when the vocabulary holds
    target ``tags`` (opus-mt-en-zh's >>cmn_Hans<<...): such a model translates into the language a tag names.
    ModelImportError for a code that is none, or one side given and the other not stated."""
    named = _OPUS_NAME.fullmatch(origin.rsplit("/", 1)[-1])
    stated = [code if code not in GROUP_CODES else None for code in (named.groups() if named else (None, None))]
    if tags:
        stated[1] = None
    src, tgt = src_lang or stated[0], tgt_lang or stated[1]
    if src_lang is None and tgt_lang is None and None in (src, tgt):
        src, tgt = DataConfig.src_lang, DataConfig.tgt_lang
    elif src is None or tgt is None:
        side, flag = ("source", "--src-lang") if src is None else ("target", "--tgt-lang")
        raise ModelImportError(f"{origin}: its name states no single {side} language; give {flag} too")
    for flag, code in (("--src-lang", src), ("--tgt-lang", tgt)):
        if LANGUAGE_CODE.fullmatch(code) is None:
            raise ModelImportError(
                f"{flag} {untrusted.shown(code)} is not a language code (a letter, then up to 15 letters, digits, "
                "_ or -)"
            )
    if src == tgt:
        raise ModelImportError(f"--src-lang and --tgt-lang are both {src}")
    return src, tgt


def tags_note(language_tags: str) -> str:
    """What the import says of a model into several languages, from its record's ``language_tags``."""
    tags = language_tags.split()
    shown = ", ".join(tags[:5]) + (", ..." if len(tags) > 5 else "")
    return (
        "the model translates into the language a tag at the start of its input names: begin each line with one "
        f"of its {len(tags):,} target tags ({shown})"
    )
