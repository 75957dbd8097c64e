"""Tiny real NLLB-200 and M2M100 folders, as transformers' save_pretrained writes them, for the import's tests and
the translation tests of the models it writes.

Each holds a random ``M2M100ForConditionalGeneration`` (its LayerNorms randomised too, so that a misplaced norm
shows) and the tokenizer files of a SentencePiece BPE model trained here on captions in English, German and French,
laid out as fairseq's (<unk> 0, <s> 1, </s> 2, no pad): NllbTokenizer's tokenizer.json with the 202 language codes
and <mask> as added tokens, or M2M100Tokenizer's vocab.json (fairseq's dictionary, in its own order and lacking a few
of the SentencePiece model's pieces, as M2M100's does) with its language list. Nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import captions
import sentencepiece
import torch

SMALL = {
    "encoder_layers": 2,
    "decoder_layers": 2,
    "d_model": 32,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "init_std": 0.2,
}
MTKIT_OF_FAIRSEQ = (2, 0, 3, 1)  # mtkit's id of fairseq's <s>, <pad>, </s> and <unk>; every other id is the same
SPM_PIECES = 300
LINES = captions.parallel(300, seed=11, langs=("en", "de", "fr"))


@dataclass
class FairseqFolder:
    """A model folder, the model transformers loads from it and its tokenizer (NllbTokenizer or M2M100Tokenizer)."""

    path: Path
    hf: object  # M2M100ForConditionalGeneration
    tokenizer: object
    languages: list[str]  # the codes the tokenizer takes as src_lang and tgt_lang (eng_Latn; en)


def to_mtkit(ids: torch.Tensor) -> torch.Tensor:
    """Fairseq's ids (transformers') as mtkit's: only the four special ones differ."""
    return torch.where(ids < len(MTKIT_OF_FAIRSEQ), torch.tensor(MTKIT_OF_FAIRSEQ)[ids.clamp(max=3)], ids)


def fairseq_spm(path: Path, pieces: int = SPM_PIECES) -> Path:
    """A SentencePiece BPE model of the captions in fairseq's layout (<unk> 0, <s> 1, </s> 2, no pad), as NLLB-200's
    and M2M100's sentencepiece.bpe.model are."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES["en"] + LINES["de"] + LINES["fr"]),
        model_writer=model,
        vocab_size=pieces,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def random_model(path: Path, vocab_size: int, seed: int, generation: dict, **config):
    """A random M2M100ForConditionalGeneration saved at ``path``, with fairseq's special ids."""
    import transformers

    settings = {**SMALL, "vocab_size": vocab_size, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    settings |= {"decoder_start_token_id": 2, **config}
    torch.manual_seed(seed)
    hf = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**settings)).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
        hf.get_output_embeddings().weight[2] *= 3.0  # eos likelier, so that outputs end at varied lengths
    hf.generation_config = transformers.GenerationConfig(
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, **generation
    )
    hf.save_pretrained(path)
    return hf


def nllb_folder(root: Path, seed: int = 0, hub_order: bool = False, padding_rows: int = 2, **config) -> FairseqFolder:
    """An NLLB-200 folder: NllbTokenizer (transformers 5's, built from sentencepiece.bpe.model, numbers <mask> first
    and then the 202 language codes) and ``padding_rows`` rows beyond its tokens, as NLLB-200's 256,206 are two more
    than its tokenizer's. ``hub_order``: the ids the Hub's tokenizer.json gives (transformers 4's: the codes first,
    <mask> after them)."""
    import transformers
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    source = root / "spm"
    spm = fairseq_spm(source / "sentencepiece.bpe.model")
    codes = list(FAIRSEQ_LANGUAGE_CODES)
    tokenizer = transformers.NllbTokenizer.from_pretrained(source, extra_special_tokens=codes, src_lang="eng_Latn")
    path = root / "nllb"
    tokenizer.save_pretrained(path)
    shutil.copy(spm, path / "sentencepiece.bpe.model")
    if hub_order:
        tokenizer_json = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        first = SPM_PIECES + 1
        ids = {code: first + i for i, code in enumerate(codes)} | {"<mask>": first + len(codes)}
        for token in tokenizer_json["added_tokens"]:
            token["id"] = ids.get(token["content"], token["id"])
        (path / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
        tokenizer = transformers.NllbTokenizer.from_pretrained(path)
    generation = {"max_length": 200}
    hf = random_model(path, len(tokenizer) + padding_rows, seed, generation, **config)
    return FairseqFolder(path, hf, tokenizer, codes)


def m2m100_folder(root: Path, seed: int = 0, language_codes: str = "m2m100", lacking: int = 12, **config):
    """An M2M100 folder: vocab.json numbers the SentencePiece model's pieces in another order and lacks ``lacking``
    of them, M2M100Tokenizer's language tokens follow it, then 8 madeupwords."""
    import transformers
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    source = root / "spm"
    spm = fairseq_spm(source / "sentencepiece.bpe.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    random.Random(seed).shuffle(pieces)  # fairseq's dictionary counts pieces; its order is not the model's
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab |= {piece: 4 + i for i, piece in enumerate(pieces[lacking:])}
    (source / "vocab.json").write_text(json.dumps(vocab, indent=2), encoding="utf-8")
    codes = list(FAIRSEQ_LANGUAGE_CODES[language_codes])
    tokenizer = transformers.M2M100Tokenizer(
        vocab_file=str(source / "vocab.json"),
        spm_file=str(spm),
        src_lang=codes[0],
        tgt_lang=codes[1],
        language_codes=language_codes,
    )
    path = root / "m2m100"
    tokenizer.save_pretrained(path)
    generation = {"num_beams": 5, "early_stopping": True, "max_length": 200}
    hf = random_model(path, len(vocab) + len(codes) + 8, seed, generation, **config)
    return FairseqFolder(path, hf, tokenizer, codes)
