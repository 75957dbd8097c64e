"""transformers import: a MarianMTModel folder becomes an mtkit model that computes and decodes as transformers does.

The Marian models are built here by transformers with random weights (LayerNorms and the logit bias
randomised too, so a misplaced norm, a dimension left out of the permutation or a bias on the wrong id
shows), beside SentencePiece models trained here on the test captions and a vocab.json laid out as
OPUS-MT's: eos 0, unk 1, the pieces of both languages, pad (the decoder start) last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import safetensors.torch
import sentencepiece
import torch
from helpers import invoke, one_line_error

from mtkit.config import DecodeConfig, TokenizerConfig
from mtkit.data.parallel import source_tensor
from mtkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_spm
from mtkit.decoding.search import beam_search, greedy_search, max_lengths
from mtkit.hub_folders import ModelImportError
from mtkit.interop.hf_import import import_hf
from mtkit.interop.marian_vocabulary import PAD_PIECE, START_PIECE
from mtkit.model import checkpoint, loading
from mtkit.training.init_from import import_once

with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_HUB_OFFLINE", "1")  # read as transformers loads: nothing may come from the Hub
    transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
SMALL = {
    "encoder_layers": 2,
    "decoder_layers": 2,
    "d_model": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 128,
}


def spm_pieces(path: Path) -> list[str]:
    """The pieces of a SentencePiece model trained here, less mtkit's four special ones."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    return [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]


def write_vocab(path: Path, pieces: list[str], size: int) -> dict[str, int]:
    """OPUS-MT's layout: </s> 0, <unk> 1, the pieces, filler pieces up to ``size``, <pad> last."""
    names = ["</s>", "<unk>", *dict.fromkeys(pieces)]
    names += [f"▁filler{i}" for i in range(size - 1 - len(names))]
    vocab = {piece: i for i, piece in enumerate([*names, "<pad>"])}
    path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return vocab


@dataclass
class MarianFolder:
    path: Path
    hf: object  # MarianMTModel
    tokenizer: object  # MarianTokenizer


def marian_folder(
    root: Path, corpus_files, shared: bool, vocab_size: int, seed: int, eos_scale: float = 3.0, **config
) -> MarianFolder:
    """A MarianMTModel folder as save_pretrained writes it, random weights, tokenizer files trained here; eos's
    output row is scaled by ``eos_scale``, so that hypotheses end at varied lengths."""
    root.mkdir(parents=True)
    spms = {}
    for name, lang, size in (("source", "en", 200), ("target", "de", 240)):
        lines = corpus_files[f"train.{lang}"].read_text().splitlines()
        spms[name] = train_spm(lines, root / f"spm.{name}", TokenizerConfig(vocab_size=size))
        shutil.copy(spms[name], root / f"{name}.spm")
    src_pieces, tgt_pieces = spm_pieces(spms["source"]), spm_pieces(spms["target"])
    if shared:
        vocab = write_vocab(root / "vocab.json", src_pieces + tgt_pieces, vocab_size)
        sizes = {"vocab_size": vocab_size, "decoder_vocab_size": vocab_size}
    else:
        write_vocab(root / "vocab.json", src_pieces, vocab_size + 30)  # Marian's pad id must fit both tables
        vocab = write_vocab(root / "target_vocab.json", tgt_pieces, vocab_size)
        sizes = {"vocab_size": vocab_size + 30, "decoder_vocab_size": vocab_size}
    pad = vocab["<pad>"]
    settings = {
        **SMALL,
        **sizes,
        "activation_function": "swish",
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": shared,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,
        "dropout": 0.0,
        **config,
    }
    torch.manual_seed(seed)
    hf = transformers.MarianMTModel(transformers.MarianConfig(**settings)).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
        hf.final_logits_bias.normal_(0.0, 0.5)
        hf.get_output_embeddings().weight[0] *= eos_scale
    hf.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=pad,
        pad_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        num_beams=4,
        bad_words_ids=[[pad]],
    )
    hf.save_pretrained(root / "hf")
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(root / "source.spm"),
        target_spm=str(root / "target.spm"),
        vocab=str(root / "vocab.json"),
        target_vocab_file=None if shared else str(root / "target_vocab.json"),
        separate_vocabs=not shared,
    )
    tokenizer.save_pretrained(root / "hf")
    return MarianFolder(root / "hf", hf, tokenizer)


@dataclass
class Imported:
    marian: MarianFolder
    model_dir: Path
    bundle: loading.InferenceBundle
    src_ids: dict[int, int]  # Marian source id -> mtkit id
    tgt_ids: dict[int, int]  # Marian target id -> mtkit id
    lines: list[str]


def imported(marian: MarianFolder, out: Path, lines: list[str]) -> Imported:
    import_hf(str(marian.path), out)
    bundle = loading.load_for_inference(out, CPU, "fp32")  # parity with transformers holds at fp32, on every CPU
    tok = marian.tokenizer

    def mapping(vocab: dict[str, int], mtkit: Tokenizer) -> dict[int, int]:
        ids = {piece: i for i, piece in enumerate(mtkit.sp.id_to_piece(list(range(mtkit.vocab_size))))}
        ids["<pad>"] = BOS_ID  # Marian's pad, the decoder start, is mtkit's bos
        return {i: ids[piece] for piece, i in vocab.items()}

    tgt_vocab = tok.target_encoder if tok.separate_vocabs else tok.encoder
    return Imported(
        marian, out, bundle, mapping(tok.encoder, bundle.src_tok), mapping(tgt_vocab, bundle.tgt_tok), lines
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory, corpus_files) -> Imported:
    """One vocabulary shared by the two languages, tied embeddings: OPUS-MT's usual layout."""
    root = tmp_path_factory.mktemp("shared")
    marian = marian_folder(root / "marian", corpus_files, shared=True, vocab_size=700, seed=1, init_std=0.3)
    return imported(marian, root / "model", corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(scope="module")
def separate(tmp_path_factory, corpus_files) -> Imported:
    """Two vocabularies of two sizes, the decoder's embeddings tied to the output only."""
    root = tmp_path_factory.mktemp("separate")
    marian = marian_folder(root / "marian", corpus_files, shared=False, vocab_size=400, seed=1, init_std=0.1)
    return imported(marian, root / "model", corpus_files["val.en"].read_text().splitlines())


@pytest.fixture(scope="module")
def opus_shape(tmp_path_factory, corpus_files) -> Imported:
    """Helsinki-NLP/opus-mt-en-de's shape: 6 + 6 layers, d_model 512, 8 heads, FFN 2048, swish, 58,101 shared pieces."""
    root = tmp_path_factory.mktemp("opus")
    shape = {"encoder_layers": 6, "decoder_layers": 6, "d_model": 512, "max_position_embeddings": 512}
    heads = {
        "encoder_attention_heads": 8,
        "decoder_attention_heads": 8,
        "encoder_ffn_dim": 2048,
        "decoder_ffn_dim": 2048,
    }
    marian = marian_folder(root / "marian", corpus_files, True, 58_101, seed=3, eos_scale=8.0, **shape, **heads)
    return imported(marian, root / "model", corpus_files["val.en"].read_text().splitlines()[:8])


@pytest.fixture(params=["shared", "separate", "opus_shape"])
def model(request) -> Imported:
    """Each model; the OPUS-MT-sized one is decoded on 8 lines only, its 58,101-piece output being slow on a CPU."""
    return request.getfixturevalue(request.param)


def to_mtkit(ids: torch.Tensor, mapping: dict[int, int]) -> torch.Tensor:
    return ids.clone().apply_(lambda i: mapping[i])


def test_tokenizer_gives_marian_ids(model):
    batch = model.marian.tokenizer(model.lines)["input_ids"]
    assert [[model.src_ids[i] for i in ids] for ids in batch] == [
        [*ids, EOS_ID] for ids in model.bundle.src_tok.encode(model.lines)
    ]


def test_logits_equal_transformers_teacher_forced(model, corpus_files):
    tok = model.marian.tokenizer
    targets = corpus_files["val.de"].read_text().splitlines()[: len(model.lines)]
    batch = tok(model.lines, text_target=targets, return_tensors="pt", padding=True)
    start = model.marian.hf.config.decoder_start_token_id
    labels = batch["labels"]
    labelled = labels != tok.pad_token_id  # MarianTokenizer pads labels with the source side's pad id
    real = torch.cat([torch.ones_like(labelled[:, :1]), labelled[:, :-1]], dim=1)  # start + all but the last
    decoder_in = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1).masked_fill(~real, start)
    with torch.no_grad():
        expected = model.marian.hf(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_in
        ).logits
        src = to_mtkit(batch["input_ids"], model.src_ids).masked_fill(batch["attention_mask"] == 0, PAD_ID)
        tgt_in = to_mtkit(decoder_in, model.tgt_ids).masked_fill(~real, PAD_ID)
        got = model.bundle.model(src, src == PAD_ID, tgt_in)
    columns = torch.tensor([model.tgt_ids[i] for i in range(expected.size(-1))])
    scale = expected[real].abs().max().item()  # 1e-4 of the largest logit: float32 sums in another order
    torch.testing.assert_close(got[real][:, columns], expected[real], atol=1e-4 * max(scale, 1.0), rtol=1e-4)
    assert (got[real][:, PAD_ID] < -1000).all()  # the new padding id takes no share of the softmax


def marian_outputs(
    model: Imported, decode: DecodeConfig, **options
) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """transformers' and mtkit's output ids (mtkit's numbering, no start or eos) and each line's length cap."""
    src, src_pad_mask = source_tensor(model.bundle.src_tok.encode(model.lines))
    caps = max_lengths(src_pad_mask, decode.max_len_a, decode.max_len_b, model.bundle.cfg.model.max_positions)
    batch = model.marian.tokenizer(model.lines, return_tensors="pt", padding=True)
    outputs: list[list[int]] = [[] for _ in model.lines]
    for cap in caps.unique().tolist():
        rows = (caps == cap).nonzero().flatten()
        generated = model.marian.hf.generate(
            input_ids=batch["input_ids"][rows],
            attention_mask=batch["attention_mask"][rows],
            max_new_tokens=cap,
            **options,
        )
        for row, ids in zip(rows.tolist(), generated.tolist()):
            outputs[row] = [model.tgt_ids[t] for t in ids[1:] if t not in (0, model.marian.hf.config.pad_token_id)]
    if decode.beam == 1:
        ours = greedy_search(model.bundle.model, src, src_pad_mask, decode)
    else:
        ours = [hyps[0].tokens for hyps in beam_search(model.bundle.model, src, src_pad_mask, decode)]
    return outputs, ours, caps


def test_greedy_ids_equal_generate(model):
    got, expected, _ = marian_outputs(model, DecodeConfig(beam=1), num_beams=1)
    assert got == expected
    assert sum(len(ids) > 3 for ids in expected) >= 3  # non-trivial outputs


def test_beam_best_hypothesis_equals_generate(model):
    """Length penalty 0 (raw log-probability sums) and fairseq's stopping rule on both sides: one algorithm,
    which may differ only at the length cap, where transformers forces eos with a log-probability of 0 (so a cut
    hypothesis can beat one that ended): compared on the lines whose best hypotheses both ended before it."""
    decode = DecodeConfig(beam=5, lenpen=0.0, early_stop=False)
    got, expected, caps = marian_outputs(model, decode, num_beams=5, length_penalty=0.0, early_stopping=True)
    ended = [i for i in range(len(got)) if max(len(expected[i]), len(got[i])) < caps[i] - 1]
    same = sum(got[i] == expected[i] for i in ended)
    assert len(ended) >= 3 and same == len(ended), f"{same} of {len(ended)} best hypotheses equal"


@pytest.mark.parametrize("name", ["shared", "separate"])
def test_beam_at_the_imported_settings_equals_generate_at_its_default_length_penalty(name, request):
    """The import records transformers' ranking: length ** length_penalty (decode.length_penalty power, lenpen 1.0,
    transformers' default) and the end of a sentence's search once num_beams hypotheses have ended (early_stop
    false; generate's early_stopping true). GNMT's ((5 + length) / 6) and mtkit's own early stop agreed on none of
    these lines, and left most outputs empty. Compared where both best hypotheses ended before the cap (the
    OPUS-MT-sized model's 8 lines mostly reach it)."""
    model = request.getfixturevalue(name)
    decode = dataclasses.replace(model.bundle.cfg.decode, beam=4)
    got, expected, caps = marian_outputs(model, decode, num_beams=4, early_stopping=True)
    ended = [i for i in range(len(got)) if max(len(expected[i]), len(got[i])) < caps[i] - 1]
    same = sum(got[i] == expected[i] for i in ended)
    assert len(ended) >= 3 and same == len(ended), f"{same} of {len(ended)} best hypotheses equal"
    assert sum(not ids for ids in expected) <= len(expected) // 10  # few empty outputs
    assert (decode.length_penalty, decode.lenpen, decode.early_stop) == ("power", 1.0, False)


def test_translate_cli_takes_the_imported_model(shared, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("\n".join(shared.lines[:5]) + "\n", encoding="utf-8")
    args = ("-i", source, "-o", tmp_path / "out.de", "--beam", 2, "--precision", "fp32", "--device", "cpu")
    result = invoke("translate", shared.model_dir, *args)
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "out.de").read_text(encoding="utf-8").splitlines()) == 5


def hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> None:
    """``folder`` laid out in huggingface_hub's cache as ``repo_id`` at ``commit``, the main branch pointing at it:
    each file of the snapshot a link to its content in the repository's blobs/."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (repo / "snapshots" / commit / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_import_from_the_hub_cache_offline(separate, hf_offline, tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub (offline: its cache only) to the same model as the folder."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub_cache(cache, "Helsinki-NLP/opus-mt-xx-yy", separate.marian.path)
    result = invoke("import", "hf", "Helsinki-NLP/opus-mt-xx-yy", "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output
    meta = checkpoint.read_checkpoint(tmp_path / "model", with_state=False).meta
    assert meta["imported"]["source"] == "hf:Helsinki-NLP/opus-mt-xx-yy" and meta["imported"]["revision"] == "0" * 40
    hub = loading.load_for_inference(tmp_path / "model", CPU).model.state_dict()
    assert all(torch.equal(hub[k], v) for k, v in separate.bundle.model.state_dict().items())
    result = invoke("import", "hf", "Helsinki-NLP/not-cached", "-o", tmp_path / "other")
    assert result.exit_code == 1 and "hf:Helsinki-NLP/not-cached: not in the local Hugging Face cache" in result.output


def broken_copy(source: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    edit(folder)
    return folder


def edit_json(name: str, **changes):
    def edit(folder: Path) -> None:
        values = json.loads((folder / name).read_text())
        values.update(changes)
        (folder / name).write_text(json.dumps(values))

    return edit


def replace_weights(change):
    def edit(folder: Path) -> None:
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        change(weights)
        safetensors.torch.save_file(weights, folder / "model.safetensors")

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (edit_json("config.json", model_type="bart"), "model_type must be marian"),
        (edit_json("config.json", normalize_before=True), "normalize_before is set"),
        (edit_json("config.json", normalize_embedding=True), "normalize_embedding is set"),
        (edit_json("config.json", add_final_layer_norm=True), "add_final_layer_norm is set"),
        (edit_json("config.json", static_position_embeddings=False), "static_position_embeddings false asks for"),
        (edit_json("config.json", scale_embedding=False), "scale_embedding false"),
        (edit_json("config.json", activation_function="tanh"), "activation_function 'tanh' is not one of"),
        (edit_json("config.json", decoder_ffn_dim=64), "decoder_ffn_dim 64 differs from encoder_ffn_dim 128"),
        (edit_json("config.json", vocab_size=2**21, decoder_vocab_size=2**21), "a vocabulary of over 1,048,576"),
        (edit_json("config.json", d_model="64"), "d_model must be int"),
        (edit_json("config.json", decoder_start_token_id=0), "decoder_start_token_id 0 is not pad_token_id"),
        (edit_json("vocab.json", **{"▁filler1": 0}), "its ids must be 0 to"),
        (lambda f: (f / "vocab.json").write_text("[1, 2]"), "must map 700 pieces"),
        (lambda f: (f / "config.json").write_text("{" * 100_000), "not readable JSON"),
        (lambda f: (f / "source.spm").write_bytes(b"\x00garbage"), "source.spm: not a SentencePiece model"),
        (lambda f: (f / "target.spm").unlink(), "no target.spm"),
        (replace_weights(lambda w: w.update(extra=torch.zeros(1))), "holds extra, which no Marian model"),
        (replace_weights(lambda w: w.pop("model.encoder.layers.1.fc2.bias")), "no model.encoder.layers.1.fc2.bias"),
        (
            replace_weights(lambda w: w.update({"model.shared.weight": torch.zeros(700, 32)})),
            "model.shared.weight is (700, 32), config.json makes it (700, 64)",
        ),
        (
            replace_weights(lambda w: w.update({"model.decoder.embed_positions.weight": torch.zeros(128, 64)})),
            "is not Marian's sinusoidal table",
        ),
        (
            replace_weights(lambda w: w.update({"final_logits_bias": torch.zeros(1, 700, dtype=torch.int32)})),
            "final_logits_bias is torch.int32, not a floating-point tensor",
        ),
    ],
)
def test_a_folder_mtkit_cannot_express_or_trust_is_refused_in_one_line(shared, tmp_path, edit, message):
    folder = broken_copy(shared.marian.path, tmp_path, edit)
    result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "model").exists()


def test_a_pickle_that_runs_code_is_refused(shared, tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    def edit(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        torch.save({"weights": Payload()}, folder / "pytorch_model.bin")

    folder = broken_copy(shared.marian.path, tmp_path, edit)
    result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    assert result.exit_code == 1 and "refused: it holds pickled Python objects" in result.output


def test_pytorch_model_bin_in_fp16_imports_the_same_model(separate, tmp_path):
    """Older repositories hold pytorch_model.bin, OPUS-MT's often in fp16; widening to float32 keeps every value."""

    def edit(folder: Path) -> None:
        weights = safetensors.torch.load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save({k: v.half() for k, v in weights.items()}, folder / "pytorch_model.bin")

    folder = broken_copy(separate.marian.path, tmp_path, edit)
    import_hf(str(folder), tmp_path / "model")
    half = loading.load_for_inference(tmp_path / "model", CPU).model.state_dict()
    full = separate.bundle.model.state_dict()
    assert all(torch.equal(half[k], full[k].half().float()) for k in full)


def test_an_existing_output_folder_is_not_overwritten(shared, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    result = invoke("import", "hf", shared.marian.path, "-o", tmp_path / "model")
    assert result.exit_code == 1 and "exists and is not empty" in result.output
    assert (tmp_path / "model" / "notes.txt").read_text() == "mine"


def test_export_back_to_transformers_gives_the_original_logits(separate, corpus_files, tmp_path):
    """Imported, then exported with `mtkit export --format hf`: transformers loads it and computes the original's
    log-probabilities of the same text (the export numbers pieces as mtkit does, so pieces are matched by name)."""
    result = invoke("export", separate.model_dir, "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    back = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    back_tok = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    lines, targets = separate.lines[:10], corpus_files["val.de"].read_text().splitlines()[:10]

    def log_probs(model, tok) -> tuple[torch.Tensor, torch.Tensor]:
        batch = tok(lines, text_target=targets, return_tensors="pt", padding=True)
        start = model.config.decoder_start_token_id
        labels = batch["labels"].masked_fill(batch["labels"] == tok.pad_token_id, start)
        decoder_in = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)
        with torch.no_grad():
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
            logits = model(**inputs, decoder_input_ids=decoder_in).logits
        return logits.log_softmax(-1), labels != start

    original, real = log_probs(separate.marian.hf, separate.marian.tokenizer)
    exported, same_real = log_probs(back, back_tok)
    assert torch.equal(real, same_real)
    # Marian's pad, the decoder start, is mtkit's bos, which the export calls <s>; the export's own <pad> is new
    names = {"<pad>": "<s>"}
    columns = [back_tok.target_encoder[names.get(piece, piece)] for piece in separate.marian.tokenizer.target_encoder]
    torch.testing.assert_close(exported[real][:, columns], original[real], atol=1e-4, rtol=1e-4)


def test_importing_the_export_of_an_import_gives_the_first_imports_logits(separate, corpus_files, tmp_path):
    """An imported model, exported and imported again: the second import recognises mtkit's export and keeps
    its ids, so it encodes and computes as the first."""
    assert invoke("export", separate.model_dir, "--format", "hf", "-o", tmp_path / "hf").exit_code == 0
    result = invoke("import", "hf", tmp_path / "hf", "-o", tmp_path / "again")
    assert result.exit_code == 0, result.output
    again = loading.load_for_inference(tmp_path / "again", CPU, "fp32")
    first = separate.bundle
    lines, targets = separate.lines, corpus_files["val.de"].read_text().splitlines()
    assert again.src_tok.encode(lines) == first.src_tok.encode(lines)
    assert again.tgt_tok.encode(targets) == first.tgt_tok.encode(targets)
    src, src_pad_mask = source_tensor(first.src_tok.encode(lines))
    tgt_in, _ = source_tensor([[BOS_ID, *t] for t in first.tgt_tok.encode(targets)])
    with torch.no_grad():
        expected, got = (bundle.model(src, src_pad_mask, tgt_in) for bundle in (first, again))
    real = tgt_in != PAD_ID
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_ctranslate2_export_gives_generates_greedy_ids(separate, tmp_path):
    """Imported, then exported with `mtkit export` (CTranslate2): CTranslate2's own greedy search, called as its users
    call it, gives transformers' output on every line (up to the cap, where transformers forces eos)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    result = invoke("export", separate.model_dir, "-o", tmp_path / "ct2")
    assert result.exit_code == 0, result.output
    got, _, caps = marian_outputs(separate, DecodeConfig(beam=1), num_beams=1)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    src_tok, tgt_tok = separate.bundle.src_tok, separate.bundle.tgt_tok
    pieces = [src_tok.sp.id_to_piece(ids) for ids in src_tok.encode(separate.lines)]
    outputs: list[list[str]] = [[] for _ in pieces]
    for cap in caps.unique().tolist():
        rows = (caps == cap).nonzero().flatten().tolist()
        results = translator.translate_batch(
            [pieces[row] for row in rows],
            beam_size=1,
            max_decoding_length=cap,
            min_decoding_length=0,  # CTranslate2's default, 1, would forbid an empty output
            suppress_sequences=[[PAD_PIECE], [START_PIECE]],  # mtkit's pad and bos (Marian's pad): never outputs
            return_end_token=True,
        )
        for row, translated in zip(rows, results):
            outputs[row] = translated.hypotheses[0]
    ended = 0
    for i, hypothesis in enumerate(outputs):
        ids = [tgt_tok.sp.piece_to_id(piece) for piece in hypothesis if piece != "</s>"]
        assert ids[: len(got[i])] == got[i]
        if hypothesis[-1] == "</s>":
            ended += 1
            assert ids == got[i]
    assert ended >= 5


def validation_nll(bundle: loading.InferenceBundle, sources: list[str], targets: list[str]) -> float:
    """Mean negative log-likelihood per reference token (eos included), teacher-forced."""
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad([torch.tensor([*ids, EOS_ID]) for ids in bundle.src_tok.encode(sources)], True, PAD_ID)
    refs = bundle.tgt_tok.encode(targets)
    tgt_in = pad([torch.tensor([BOS_ID, *ids]) for ids in refs], True, PAD_ID)
    tgt_out = pad([torch.tensor([*ids, EOS_ID]) for ids in refs], True, PAD_ID)
    with torch.no_grad():
        logits = bundle.model.eval()(src, src == PAD_ID, tgt_in)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID).item()


def test_fine_tuning_an_imported_model_lowers_its_validation_loss_and_keeps_it_whole(shared, corpus_files, tmp_path):
    """`train.init_from: hf:FOLDER` imports the Marian model into the run (RUN/imported/) and starts from it: its
    tokenizers and numbering go with it, the loss on held-out captions falls, and the result still exports."""
    config = tmp_path / "finetune.yaml"
    data = {k: str(corpus_files[f]) for k, f in (("train_src", "train.en"), ("train_tgt", "train.de"))}
    data |= {"valid_src": str(corpus_files["val.en"]), "valid_tgt": str(corpus_files["val.de"]), "max_tokens": 100}
    train = {"init_from": f"hf:{shared.marian.path}", "schedule": "constant", "lr": 1e-3, "warmup": 10, "max_steps": 60}
    train |= {"batch_tokens": 1024, "valid_every": 60, "save_every": 60, "valid_bleu": False, "best_metric": "loss"}
    train |= {"precision": "fp32", "device": "cpu"}
    config.write_text(json.dumps({"data": data, "train": train}))  # JSON is YAML
    result = invoke("train", config, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "imported" / "model.safetensors").is_file()
    tuned = loading.load_for_inference(tmp_path / "run", CPU)
    assert tuned.src_tok.sha256 == shared.bundle.src_tok.sha256 and tuned.tgt_tok.sha256 == shared.bundle.tgt_tok.sha256
    assert tuned.cfg.model == shared.bundle.cfg.model
    sources, targets = corpus_files["val.en"].read_text().splitlines(), corpus_files["val.de"].read_text().splitlines()
    before, after = validation_nll(shared.bundle, sources, targets), validation_nll(tuned, sources, targets)
    assert after < 0.7 * before, (before, after)
    result = invoke("export", tmp_path / "run", "--format", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert transformers.MarianMTModel.from_pretrained(tmp_path / "hf").config.activation_function == "swish"


def test_the_fine_tuning_recipe_runs_end_to_end_from_a_marian_folder(shared, multi30k_mirror, tmp_path):
    """recipes/multi30k_en_de_finetune.yaml as shipped, but for the model (a Marian folder in place of the Hub's
    OPUS-MT) and a budget of a few updates."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "multi30k_en_de_finetune.yaml"
    settings = [f"train.init_from=hf:{shared.marian.path}", "train.max_steps=6", "train.valid_every=6"]
    settings += ["train.save_every=6", "train.warmup=2", "train.batch_tokens=1024", "train.precision=fp32"]
    settings += ["train.device=cpu"]
    settings += ["data.max_tokens=100", "decode.beam=2"]  # the test model's 128 positions; a quick search
    settings += [f"recipe.data_dir={tmp_path / 'prepared'}"]  # not the session's: test_run.py prepares it afresh
    options = [arg for setting in settings for arg in ("--set", setting)]
    result = invoke("run", recipe, "--out", tmp_path / "run", "--mirror", multi30k_mirror, *options)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["training"]["updates"] == 6 and [s["name"] for s in report["scores"]] == ["BLEU", "chrF2", "TER"]
    assert report["model"].endswith("best") and report["verdict"] == "not reproduced"  # a random model, 6 updates
    assert (tmp_path / "run" / "imported" / "model.safetensors").is_file()


# -- real config.json files, languages, hostile folders ----------------------------------------------------------

REAL_CONFIGS = Path(__file__).with_name("fixtures_marian")
# config.json's keys that fix the test model's sizes, ids and activation: a real file's values of them are replaced
SIZED = ("vocab_size", "decoder_vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_hidden_layers")
SIZED += ("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
SIZED += ("max_position_embeddings", "pad_token_id", "decoder_start_token_id", "eos_token_id", "forced_eos_token_id")
SIZED += ("bos_token_id", "bad_words_ids", "activation_function")


@pytest.mark.parametrize("name", sorted(p.name for p in REAL_CONFIGS.glob("*.config.json")))
def test_real_opus_mt_config_files_import_as_the_model_they_describe(shared, tmp_path, name):
    """config.json as published with OPUS-MT models (converted by transformers' Marian script, older versions'
    field sets too: static_position_embeddings true, the BART family's options false), its sizes and ids replaced
    by the test model's: the import reads it as the config transformers saved for that model."""
    real = json.loads((REAL_CONFIGS / name).read_text())
    saved = json.loads((shared.marian.path / "config.json").read_text())
    real.update({key: saved[key] for key in SIZED if key in saved and key in real})
    folder = broken_copy(shared.marian.path, tmp_path, lambda f: (f / "config.json").write_text(json.dumps(real)))
    import_hf(str(folder), tmp_path / "model")
    bundle = loading.load_for_inference(tmp_path / "model", CPU, "fp32")
    assert bundle.cfg.model == replace(shared.bundle.cfg.model, dropout=real["dropout"])
    expected = shared.bundle.model.state_dict()
    assert all(torch.equal(bundle.model.state_dict()[k], v) for k, v in expected.items())


def test_the_import_records_the_languages_given_or_named(shared, hf_offline, tmp_path, monkeypatch):
    """--src-lang/--tgt-lang, or an OPUS-MT name, give the model its languages: `--tgt-lang de` translates, and the
    model can teach a student of en->de; a name that states none leaves mtkit's src->tgt."""
    import huggingface_hub

    from mtkit.config import DataConfig, RunConfig
    from mtkit.workflows.distillation import student_tokenizer

    result = invoke("import", "hf", shared.marian.path, "--src-lang", "en", "--tgt-lang", "de", "-o", tmp_path / "a")
    assert result.exit_code == 0 and "(en->de)" in result.output, result.output
    source = tmp_path / "in.en"
    source.write_text("\n".join(shared.lines[:3]) + "\n", encoding="utf-8")
    args = ("-i", source, "-o", tmp_path / "out.de", "--tgt-lang", "de", "--precision", "fp32", "--device", "cpu")
    result = invoke("translate", tmp_path / "a", *args)
    assert result.exit_code == 0, result.output
    student = RunConfig(data=DataConfig(src_lang="en", tgt_lang="de"))
    assert student_tokenizer(student, (tmp_path / "a",)).tgt_model.endswith("spm.tgt.model")  # a teacher of en->de

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    hub_cache(cache, "Helsinki-NLP/opus-mt-en-de", shared.marian.path)
    result = invoke("import", "hf", "Helsinki-NLP/opus-mt-en-de", "-o", tmp_path / "b")
    assert result.exit_code == 0 and "(en->de)" in result.output, result.output
    result = invoke("import", "hf", shared.marian.path, "-o", tmp_path / "c")
    assert result.exit_code == 0 and "(src->tgt)" in result.output, result.output
    one_line_error(invoke("import", "hf", shared.marian.path, "--tgt-lang", "de", "-o", tmp_path / "d"), "--src-lang")
    one_line_error(
        invoke("import", "hf", shared.marian.path, "--src-lang", "e n", "--tgt-lang", "de", "-o", tmp_path / "d"),
        "--src-lang 'e n' is not a language code",
    )


def import_in_3_gib(folder: Path, out: Path) -> subprocess.CompletedProcess:
    """`mtkit import hf FOLDER -o OUT` in a process limited to 3 GiB of address space: torch and the test model fit,
    and a model or tensor of gigabytes could not be allocated."""
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
        "from mtkit.cli import main; sys.argv = ['mtkit', 'import', 'hf', sys.argv[1], '-o', sys.argv[2]]; main()"
    )
    return subprocess.run([sys.executable, "-c", script, folder, out], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"encoder_layers": 1000, "decoder_layers": 1000, "d_model": 1024}, "encoder_layers is 1,000, and"),
        ({"d_model": 65536}, ", config.json makes it ("),
        ({"encoder_ffn_dim": 2**31 - 1, "decoder_ffn_dim": 2**31 - 1}, "encoder_ffn_dim 2,147,483,647 is beyond"),
        ({"encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096}, "is (128,), config.json makes it (4096,)"),
    ],
)
def test_a_config_json_of_another_model_is_refused_before_anything_is_allocated(shared, tmp_path, changes, message):
    """config.json is compared with the weights file's header, never built first: building the model it describes
    (2,000 layers, 16 GiB or 512 GiB) ran out of memory, or ended in a traceback."""
    folder = broken_copy(shared.marian.path, tmp_path, edit_json("config.json", **changes))
    done = import_in_3_gib(folder, tmp_path / "model")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "config.json" in done.stderr and message in done.stderr, done.stderr
    assert not (tmp_path / "model").exists()
    with pytest.raises(ModelImportError, match="config.json"):  # the same through train.init_from: hf:FOLDER
        import_once(f"hf:{folder}", tmp_path / "run")


def with_sparse_tensor(folder: Path) -> None:
    """model.safetensors with a 4 GiB tensor "extra" after the model's, its bytes a hole in a sparse file."""
    path = folder / "model.safetensors"
    with safetensors.safe_open(path, framework="pt") as f:
        tensors = {key: f.get_tensor(key).contiguous() for key in f.keys()}
    header, data, offset = {}, [], 0
    for key, tensor in tensors.items():
        raw = tensor.numpy().tobytes()
        header[key] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    header["extra"] = {"dtype": "F32", "shape": [1 << 30], "data_offsets": [offset, offset + (4 << 30)]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(data))
        f.truncate(8 + len(text) + offset + (4 << 30))


def test_a_weights_file_is_checked_by_its_header_before_a_tensor_is_read(shared, tmp_path):
    """model.safetensors was read whole before any check: a file holding a tensor of gigabytes ran out of memory."""
    folder = broken_copy(shared.marian.path, tmp_path, with_sparse_tensor)
    done = import_in_3_gib(folder, tmp_path / "model")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "model.safetensors: holds extra, which no Marian model of config.json has" in done.stderr, done.stderr


def nan_weight(weights: dict[str, torch.Tensor]) -> None:
    weights["model.decoder.layers.1.fc1.weight"][3, 5] = float("nan")


def test_non_finite_weights_are_refused_at_import(shared, tmp_path):
    """One NaN made greedy search write garbage with exit status 0 and beam search end in an IndexError."""
    folder = broken_copy(shared.marian.path, tmp_path, replace_weights(nan_weight))
    one_line_error(
        invoke("import", "hf", folder, "-o", tmp_path / "model"),
        "model.decoder.layers.1.fc1.weight holds NaN or infinite values",
    )
    assert not (tmp_path / "model").exists()


def test_non_finite_weights_are_refused_at_load(shared, tmp_path):
    """A checkpoint whose weights hold an infinity (written by anything but mtkit) is refused by name."""
    shutil.copytree(shared.model_dir, tmp_path / "loaded")
    weights_path = tmp_path / "loaded" / "model.safetensors"
    with safetensors.safe_open(weights_path, framework="pt") as f:
        header, weights = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    weights["decoder.layers.0.ffn.up.weight"][0, 0] = float("inf")
    safetensors.torch.save_file(weights, weights_path, metadata=header)
    source = tmp_path / "in.en"
    source.write_text(shared.lines[0] + "\n", encoding="utf-8")
    for beam in (1, 2):
        result = invoke(
            "translate", tmp_path / "loaded", "-i", source, "--beam", beam, "--precision", "fp32", "--device", "cpu"
        )
        one_line_error(result, "model.safetensors: weight decoder.layers.0.ffn.up.weight holds NaN or infinite values")


def test_a_link_out_of_the_model_folder_is_refused(shared, tmp_path):
    """A folder's files are read where they are: a link leading elsewhere (a downloaded folder's vocab.json linked to
    a file of the importing machine) is refused, not followed; links inside the folder are read."""
    outside = tmp_path / "elsewhere.json"
    shutil.copy(shared.marian.path / "vocab.json", outside)

    def link_out(folder: Path) -> None:
        (folder / "vocab.json").unlink()
        (folder / "vocab.json").symlink_to(outside)

    folder = broken_copy(shared.marian.path, tmp_path, link_out)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), "vocab.json: a link to", "outside")
    (folder / "vocab.json").unlink()
    shutil.copy(outside, folder / "kept.json")
    (folder / "vocab.json").symlink_to("kept.json")
    result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output


def rename_piece(piece: str, name: str):
    def edit(folder: Path) -> None:
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        vocab[name] = vocab.pop(piece)
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")

    return edit


def swap_spm(folder: Path) -> None:
    (folder / "source.spm").rename(folder / "swap")
    (folder / "target.spm").rename(folder / "source.spm")
    (folder / "swap").rename(folder / "target.spm")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (swap_spm, "pieces are not in vocab.json"),
        (lambda f: shutil.copy(f / "source.spm", f / "target.spm"), "pieces are not in target_vocab.json"),
        (edit_json("tokenizer_config.json", unk_token="</s>"), "must be three pieces"),
        (rename_piece("▁filler3", ""), "not a usable SentencePiece model (INTERNAL: piece must not be empty.)"),
        (rename_piece("▁filler3", START_PIECE), "holds a piece named <s>, the name mtkit gives a special id"),
        (rename_piece("▁filler3", PAD_PIECE), "holds a piece named <mtkit:pad>, the name mtkit gives a special id"),
    ],
)
def test_tokenizer_files_that_do_not_fit_the_vocabulary_are_refused(separate, tmp_path, edit, message):
    """A SentencePiece model of another vocabulary (swapped sides, another model's) encoded most text as unk, and
    special pieces named twice made a tokenizer that no command could load: the import reported success."""
    folder = broken_copy(separate.marian.path, tmp_path, edit)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), message)
    assert not (tmp_path / "model").exists()


def test_vocab_json_is_bounded_by_the_size_config_json_gives_it(shared, tmp_path):
    """700 pieces take 14 kB: a vocab.json grown with blanks to 1 MB is refused before it is parsed."""

    def pad(folder: Path) -> None:
        text = (folder / "vocab.json").read_text(encoding="utf-8")
        (folder / "vocab.json").write_text(text[:-1] + " " * (1 << 20) + "}", encoding="utf-8")

    folder = broken_copy(shared.marian.path, tmp_path, pad)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), "more than the 68,224 config.json's 700")


def test_an_output_folder_that_is_a_link_is_written_through(shared, tmp_path):
    """`-o LINK` to an empty folder writes the model into the folder the link names, and the link stays."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    result = invoke("import", "hf", shared.marian.path, "-o", tmp_path / "link")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
    assert loading.load_for_inference(tmp_path / "link", CPU).step == 0


def real_config(shared: Imported, name: str) -> dict:
    """A real config.json of ``tests/fixtures_marian``, its sizes and ids the test model's."""
    real = json.loads((REAL_CONFIGS / name).read_text())
    saved = json.loads((shared.marian.path / "config.json").read_text())
    real.update({key: saved[key] for key in SIZED if key in saved and key in real})
    return real


@pytest.mark.parametrize(
    ("config", "generation", "expected"),
    [
        ("opus-mt-en-de.config.json", None, (4, 1.0)),  # num_beams in config.json, as older transformers saved it
        ("opus-mt-en-de.transformers-3.config.json", None, (6, 1.0)),
        ("opus-mt-en-de.config.json", {"num_beams": 3, "length_penalty": 0.6}, (3, 0.6)),
        ("opus-mt-tc-big-en-pt.config.json", {"length_penalty": 1.5}, (4, 1.5)),
        ({"num_beams": 2, "length_penalty": 0.8}, None, (2, 0.8)),
        ({"num_beams": None}, {"num_beams": None}, (DecodeConfig.beam, 1.0)),
    ],
)
def test_beam_and_length_penalty_are_read_from_generation_config_json_else_config_json(
    shared, tmp_path, config, generation, expected
):
    """num_beams and length_penalty, generate's defaults, become decode.beam and decode.lenpen (length ** lenpen):
    a folder saved by older transformers holds them in config.json, newer ones in generation_config.json. Read
    from generation_config.json alone, OPUS-MT's num_beams 4 in config.json imported as beam 5, and a
    length_penalty anywhere as 1.0."""

    def edit(folder: Path) -> None:
        values = real_config(shared, config) if isinstance(config, str) else {**shared.marian.hf.config.to_dict()}
        if not isinstance(config, str):
            values.update(config)
        (folder / "config.json").write_text(json.dumps(values))
        (folder / "generation_config.json").unlink()
        if generation is not None:
            (folder / "generation_config.json").write_text(json.dumps(generation))

    folder = broken_copy(shared.marian.path, tmp_path, edit)
    result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output
    decode = checkpoint.read_meta(tmp_path / "model")[1].decode
    assert (decode.beam, decode.lenpen, decode.length_penalty, decode.early_stop) == (*expected, "power", False)


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("generation_config.json", {"length_penalty": 11.0}, "generation_config.json: length_penalty 11.0 is not"),
        ("generation_config.json", {"length_penalty": -1}, "length_penalty -1 is not a number from 0 to 10.0"),
        ("config.json", {"length_penalty": "long"}, "config.json: length_penalty 'long' is not a number"),
        ("generation_config.json", {"num_beams": 0}, "generation_config.json: num_beams 0 is not a whole number"),
        ("config.json", {"num_beams": 65}, "config.json: num_beams 65 is not a whole number from 1 to 64"),
    ],
)
def test_a_beam_or_length_penalty_mtkit_cannot_hold_is_refused(shared, tmp_path, name, values, message):
    def edit(folder: Path) -> None:
        if name == "config.json":
            (folder / "generation_config.json").unlink()
        edit_json(name, **values)(folder)

    folder = broken_copy(shared.marian.path, tmp_path, edit)
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), message)
    assert not (tmp_path / "model").exists()


def pad_vocab(size: int):
    """vocab.json grown with blanks to ``size`` bytes, still the same JSON."""

    def edit(folder: Path) -> None:
        text = (folder / "vocab.json").read_text(encoding="utf-8")
        grown = text[:-1] + " " * (size - len(text.encode())) + "}"
        (folder / "vocab.json").write_text(grown, encoding="utf-8")
        assert (folder / "vocab.json").stat().st_size == size

    return edit


def test_vocab_json_may_take_96_bytes_a_piece(shared, tmp_path):
    """700 pieces may take 1,024 + 700 * 96 bytes: a 14-character piece written as \\uXXXX escapes, its id and
    indentation (OPUS-MT's take 21 on average). 256 a piece let a vocabulary of 2 ** 20 pieces parse 64 MiB."""
    bound = 1024 + 700 * 96
    folder = broken_copy(shared.marian.path, tmp_path, pad_vocab(bound))
    assert invoke("import", "hf", folder, "-o", tmp_path / "model").exit_code == 0
    pad_vocab(bound + 1)(folder)
    one_line_error(
        invoke("import", "hf", folder, "-o", tmp_path / "other"),
        f"vocab.json: {bound + 1:,} bytes, more than the {bound:,} config.json's 700 pieces may take",
    )


def test_a_d_model_below_16_is_refused(shared, tmp_path):
    """A 2-wide embedding let a vocabulary of a million pieces (and its vocab.json) come with a weights file of 8 MB."""
    folder = broken_copy(shared.marian.path, tmp_path, edit_json("config.json", d_model=8))
    one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), "config.json: d_model must be int >= 16")


def rewrite_safetensors(folder: Path, header_bytes: int = 0, drop_data: int = 0) -> None:
    """model.safetensors rewritten with its header padded with blanks to ``header_bytes`` (as safetensors allows),
    or its last ``drop_data`` bytes of tensor data cut off."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header, data = raw[8 : 8 + length], raw[8 + length :]
    header += b" " * max(0, header_bytes - len(header))
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[: len(data) - drop_data])


def test_a_safetensors_header_longer_than_its_tensors_need_is_refused_before_it_is_read(shared, tmp_path):
    """The header may take 512 bytes for each tensor config.json describes (and 64 KiB): safetensors' own bound,
    100 MiB, let a small folder make the import parse 100 MiB of JSON (a gigabyte of objects)."""
    folder = broken_copy(shared.marian.path, tmp_path, lambda f: rewrite_safetensors(f, header_bytes=1 << 20))
    parsed = []
    real_loads = json.loads

    def loads(text, *args, **kwargs):
        parsed.append(len(text))
        return real_loads(text, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json, "loads", loads)
        result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    one_line_error(result, "model.safetensors: not readable weights (a safetensors header of 1,048,576 bytes, more")
    assert max(parsed, default=0) < 1 << 20  # refused by its length field, not parsed


def with_dtype(dtype):
    """model.safetensors whose header gives final_logits_bias ``dtype``."""

    def edit(folder: Path) -> None:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        header["final_logits_bias"]["dtype"] = dtype
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])

    return edit


@pytest.mark.parametrize(
    "edit",
    [lambda f: rewrite_safetensors(f, drop_data=4), with_dtype("F64"), with_dtype(["F32"])],
    ids=["cut", "wider-dtype", "dtype-list"],
)
def test_a_safetensors_file_shorter_than_its_header_states_is_refused_before_a_tensor_is_read(shared, tmp_path, edit):
    """Tensors the header states but the file does not hold are refused by the header's sizes, before vocab.json is
    read: a header alone could otherwise claim any vocabulary, and so any vocab.json size."""
    folder = broken_copy(shared.marian.path, tmp_path, edit)
    one_line_error(
        invoke("import", "hf", folder, "-o", tmp_path / "model"),
        "model.safetensors: not readable weights (its header states",
    )


def named_copy(source: Path, tmp_path: Path, name: str, edit=None) -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    if edit is not None:
        edit(folder)
    return folder


def with_tags(*tags: str):
    """vocab.json with filler pieces renamed to the target tags of a model into several languages."""

    def edit(folder: Path) -> None:
        for i, tag in enumerate(tags):
            rename_piece(f"▁filler{i}", tag)(folder)

    return edit


def recorded(model: Path) -> tuple[str, str]:
    data = checkpoint.read_meta(model)[1].data
    return data.src_lang, data.tgt_lang


def test_a_group_code_or_mul_in_an_opus_mt_name_is_no_language(shared, tmp_path):
    """opus-mt-en-mul and opus-mt-tc-big-en-zle translate into many languages (mul, or zle: East Slavic, an ISO
    639-5 group) chosen by a >>xxx<< tag: recorded as en->mul or en->zle, they passed as teachers of en->zle."""
    for name in ("opus-mt-en-mul", "opus-mt-tc-big-en-zle", "opus-mt-gem-en", "opus-mt-mul-en"):
        folder = named_copy(shared.marian.path, tmp_path, name)
        result = invoke("import", "hf", folder, "-o", tmp_path / f"{name}.model")
        assert result.exit_code == 0 and "(src->tgt)" in result.output, result.output
    result = invoke("import", "hf", tmp_path / "opus-mt-en-mul", "--tgt-lang", "deu", "-o", tmp_path / "given")
    assert result.exit_code == 0 and recorded(tmp_path / "given") == ("en", "deu"), result.output
    result = invoke("import", "hf", tmp_path / "opus-mt-gem-en", "--src-lang", "de", "-o", tmp_path / "given-src")
    assert result.exit_code == 0 and recorded(tmp_path / "given-src") == ("de", "en"), result.output
    one_line_error(
        invoke("import", "hf", tmp_path / "opus-mt-tc-big-en-zle", "--src-lang", "en", "-o", tmp_path / "no"),
        "opus-mt-tc-big-en-zle: its name states no single target language; give --tgt-lang too",
    )


def test_a_vocabulary_of_target_tags_is_a_model_into_several_languages(shared, tmp_path):
    """A vocabulary holding >>xxx<< tags (opus-mt-tc-big-en-pt's >>por<< and >>pob<<) needs a tag at the start
    of each line: its name's target is not recorded, and the import says which tags it has."""
    folder = named_copy(shared.marian.path, tmp_path, "opus-mt-tc-big-en-pt", with_tags(">>por<<", ">>pob<<"))
    result = invoke("import", "hf", folder, "-o", tmp_path / "model")
    assert result.exit_code == 0 and "(src->tgt)" in result.output, result.output
    assert "begin each line with one of its 2 target tags (>>pob<<, >>por<<)" in result.output, result.output
    assert checkpoint.read_meta(tmp_path / "model")[0]["imported"]["language_tags"] == ">>pob<< >>por<<"
    result = invoke("import", "hf", folder, "--tgt-lang", "pt", "-o", tmp_path / "given")
    assert result.exit_code == 0 and recorded(tmp_path / "given") == ("en", "pt"), result.output
    assert "target tags" in result.output
    result = invoke("import", "hf", shared.marian.path, "-o", tmp_path / "plain")
    assert result.exit_code == 0 and "target tags" not in result.output, result.output


def test_a_hub_cache_snapshot_folder_imports_by_its_path(shared, tmp_path):
    """huggingface_hub's cache holds a snapshot as links into the repository's blobs/: such a folder given by its
    path imports as the Hub id would (its name and revision recorded), and was refused as links out of it."""
    cache = tmp_path / "hub"
    hub_cache(cache, "Helsinki-NLP/opus-mt-en-de", shared.marian.path, commit="a" * 40)
    snapshot = cache / "models--Helsinki-NLP--opus-mt-en-de" / "snapshots" / ("a" * 40)
    result = invoke("import", "hf", snapshot, "-o", tmp_path / "model")
    assert result.exit_code == 0 and "(en->de)" in result.output, result.output
    imported = checkpoint.read_meta(tmp_path / "model")[0]["imported"]
    assert (imported["source"], imported["revision"]) == ("hf:Helsinki-NLP/opus-mt-en-de", "a" * 40)
    elsewhere = tmp_path / "secret.json"
    shutil.copy(shared.marian.path / "vocab.json", elsewhere)
    (snapshot / "vocab.json").unlink()
    (snapshot / "vocab.json").symlink_to(elsewhere)  # a snapshot's link may lead into its repository's blobs/ only
    one_line_error(invoke("import", "hf", snapshot, "-o", tmp_path / "other"), "vocab.json: a link to", "outside")


def test_a_folder_of_links_into_a_cache_is_refused_with_the_way_to_copy_it(shared, tmp_path):
    """`huggingface-cli download --local-dir` (older huggingface_hub) left links into the cache's blobs/: the
    refusal says how to import such a folder."""
    cache = tmp_path / "hub"
    hub_cache(cache, "Helsinki-NLP/opus-mt-en-de", shared.marian.path)
    blobs = cache / "models--Helsinki-NLP--opus-mt-en-de" / "blobs"
    folder = tmp_path / "opus-mt-en-de"
    folder.mkdir()
    for file in shared.marian.path.iterdir():
        (folder / file.name).symlink_to(blobs / hashlib.sha256(file.read_bytes()).hexdigest())
    error = one_line_error(invoke("import", "hf", folder, "-o", tmp_path / "model"), "a link to", "outside")
    assert f"copy the folder with the files its links name (cp -rL {folder} COPY) and import the copy" in error
    shutil.copytree(folder, tmp_path / "copy", symlinks=False)  # what cp -rL does
    result = invoke("import", "hf", tmp_path / "copy", "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output
