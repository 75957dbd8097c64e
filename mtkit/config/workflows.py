"""The sections of `mtkit run` around training: the recipe's data and expected result, back-translation,
distillation into a student, and the dual conditional cross-entropy filter of their pairs (and of `mtkit prepare`'s
training split)."""

from dataclasses import dataclass
from typing import ClassVar, Literal

from mtkit.config.bounds import MAX_BEAM, MAX_TEACHERS, MAX_TEMPERATURE, MIN_TEMPERATURE
from mtkit.config.checks import check, check_choices
from mtkit.config.setting import setting


@dataclass(frozen=True)
class RecipeConfig:
    """What `mtkit run` does around training: where the data comes from, what result to expect."""

    corpus: str = setting(
        "",
        "an `mtkit prepare` corpus; its train/valid files become data.*, its test split is scored",
    )
    data_dir: str = setting(
        "",
        'where it is prepared; "": one folder all runs share ($MTKIT_DATA_DIR, ~/.cache/mtkit/prepared)',
    )
    average_last: int = setting(5, "score the mean of the newest K checkpoints; 0 scores best/")
    bleu_min: float = setting(0.0, "lowest test sacreBLEU that counts as reproducing the result")
    bleu_max: float = setting(100.0, "highest test sacreBLEU that counts as reproducing the result")
    expected: str = setting("", "where that range comes from (paper, BLEU variant)")
    hardware: str = setting("", "the hardware and time the recipe expects")
    comet: str = setting(
        "",
        "a COMET model to score the test set with beside BLEU, chrF and TER, its signature in the report: comet "
        "(Unbabel/wmt22-comet-da), cometkiwi (Unbabel/wmt22-cometkiwi-da), another Hub id, or a folder laid out as a "
        'Hub COMET repository; run on train.device in fp32. "": none',
    )

    def __post_init__(self) -> None:
        check(self.average_last >= 0, "recipe.average_last must be >= 0")
        check(
            0 <= self.bleu_min <= self.bleu_max <= 100, "recipe.bleu_min/bleu_max must satisfy 0 <= min <= max <= 100"
        )


@dataclass(frozen=True)
class PairFilterConfig:
    """Dual conditional cross-entropy filtering (Junczys-Dowmunt, 2018): each pair (x, y) is scored by a forward model
    A (x->y) and a reverse model B (y->x), each as a cross-entropy per token, H_A = -log p_A(y|x) / |y| and
    H_B = -log p_B(x|y) / |x| (tokens as each model reads them, eos included); the pair's score is
    |H_A - H_B| + (H_A + H_B) / 2, low when both models find the pair probable and agree on how probable. The pairs
    of lowest score are kept, in their order. In `mtkit run` it filters the pairs of its chain, as a stage of its own:
    a distillation's (after its own filters; the forward model is the teacher unless given, the reverse model is
    required) or a back-translation's (the forward model is required, the reverse model is the one that
    back-translated unless given). `mtkit prepare` takes the same settings as its --filter-* options. Neither
    ``keep`` below 1 nor ``max_score``: no filtering."""

    forward: str = setting(
        "",
        'the model of the pairs\' direction (run directory, checkpoint or .safetensors); in distillation "": the '
        "teacher",
    )
    reverse: str = setting(
        "",
        'the model of the other direction; in back-translation "": the reverse model that made the synthetic sources',
    )
    keep: float = setting(1.0, "the fraction of the pairs kept, those of lowest score (nearest whole number); 1: all")
    max_score: float = setting(
        0.0,
        "also drop every pair scored above this (the paper's adequacy exp(-score) below exp(-max_score)); 0: no limit",
    )
    scores: bool = setting(False, "also write each pair's score beside the kept pairs, as a TSV to inspect")

    def __post_init__(self) -> None:
        check(
            0.0 < self.keep <= 1.0,
            f"pair_filter.keep is the fraction of pairs kept: it must be in (0, 1], got {self.keep:g}",
        )
        check(
            self.max_score >= 0.0,
            f"pair_filter.max_score bounds cross-entropies, which are >= 0: give 0 (no limit) or more, "
            f"got {self.max_score:g}",
        )
        check(
            self.enabled or not (self.forward or self.reverse),
            "pair_filter names models but filters nothing: set pair_filter.keep below 1 or pair_filter.max_score",
        )

    @property
    def enabled(self) -> bool:
        return self.keep < 1.0 or self.max_score > 0.0


@dataclass(frozen=True)
class BackTranslationConfig:
    """What `mtkit run` does to grow the parallel data with back-translation (Sennrich et al., 2016): a model
    of the reverse direction (given, or trained on the run's parallel data first) translates target-language
    monolingual text, and the main model trains on the real pairs and these synthetic ones, each synthetic
    source tagged <BT> (Caswell et al., 2019). Empty ``monolingual``: no back-translation."""

    monolingual: str = setting("", "target-language text, one sentence per line, to back-translate")
    reverse_model: str = setting(
        "",
        'a trained model of the reverse direction (run directory, checkpoint or .safetensors); "": `mtkit run` '
        "trains one into RUN/reverse, with the run's model and train settings on its parallel data turned around",
    )
    reverse_steps: int = setting(0, "updates of that reverse model; 0: train.max_steps")
    method: Literal["sample", "beam"] = setting(
        "sample",
        "sample: each token drawn from the model's distribution, which Edunov et al. (2018) found better than beam "
        "search once there are millions of sentences; beam: the reverse model's best translation, better with little "
        "data in that study",
    )
    beam: int = setting(5, "with method beam")
    temperature: float = setting(
        1.0,
        "with method sample, as `mtkit translate --sample`: unrestricted sampling by default",
    )
    top_k: int = setting(0, "with method sample: only the k most probable tokens; 0 for all")
    top_p: float = setting(1.0, "with method sample: the smallest set of tokens holding this much probability")
    seed: int = setting(1, "of the sampling")
    weight: float = setting(1.0, "the synthetic corpus's weight when batches are drawn (data.corpora)")
    tag: bool = setting(True, "put <BT> before each synthetic source")

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {
        "MAX_BEAM": ("beam",),
        "MIN_TEMPERATURE": ("temperature",),
        "MAX_TEMPERATURE": ("temperature",),
    }

    def __post_init__(self) -> None:
        check_choices(self, "backtranslation")
        check(self.reverse_steps >= 0, "backtranslation.reverse_steps must be >= 0")
        check(1 <= self.beam <= MAX_BEAM, f"backtranslation.beam must be in [1, {MAX_BEAM}]")
        check(self.weight > 0, f"backtranslation.weight must be > 0, got {self.weight:g}")
        check(
            MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            f"backtranslation.temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
            f"got {self.temperature:g}",
        )
        check(0 < self.top_p <= 1 and self.top_k >= 0, "backtranslation.top_p must be in (0, 1], top_k >= 0")
        check(0 <= self.seed < 2**63, "backtranslation.seed must be in [0, 2**63)")


@dataclass(frozen=True)
class DistillationConfig:
    """What `mtkit run` does to train a small, fast student on a teacher's translations (sequence-level knowledge
    distillation, Kim and Rush, 2016): the teacher (given, or trained first from a recipe, one model per seed;
    several models decode as an ensemble) translates the training source by beam search, the pairs it makes
    are filtered, and this config's model, the student, trains on them with the teacher's tokenizer; then a
    shortlist is built from them and the report sets teacher and student side by side. Neither ``teacher``
    nor ``teacher_recipe``: no distillation."""

    teacher: tuple[str, ...] = setting(
        (),
        "trained models (run directories, checkpoints, .safetensors): several, an ensemble",
    )
    teacher_recipe: str = setting(
        "",
        "a recipe `mtkit run` runs first, once per seed, into RUN/teacher-SEED, when teacher is empty: a teacher of "
        "the same direction; the later seeds take the first one's tokenizer, so that they decode as an ensemble",
    )
    teacher_seeds: tuple[int, ...] = setting((1,), "train.seed of each teacher trained from teacher_recipe")
    beam: int = setting(5, "the teacher's beam on the training source (Firefox Translations uses 8)")
    nbest: int = setting(
        1,
        "of the teacher's n best translations of a line, keep the one closest to the line's reference by sentence "
        "chrF (as Firefox Translations does with its whole beam); 1: the teacher's best; at most beam",
    )
    max_ratio: float = setting(
        2.0,
        "drop pairs whose longer side, in the teacher's subword tokens (eos included), is more than this many times "
        "the shorter: a translation much longer than its source repeats itself, one much shorter leaves text out",
    )
    drop_worst: float = setting(
        0.0,
        "then drop this fraction of the pairs left: those whose translation the teacher scored lowest "
        "(length-normalised log-probability), where it was least sure of itself; 0: none",
    )
    shortlist: bool = setting(True, "build RUN/shortlist.safetensors from the distilled pairs (shortlist defaults)")

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {"MAX_TEACHERS": ("teacher_seeds", "teacher"), "MAX_BEAM": ("beam",)}

    def __post_init__(self) -> None:
        check(
            1 <= len(self.teacher_seeds) <= MAX_TEACHERS and len(self.teacher) <= MAX_TEACHERS,
            f"distillation.teacher and distillation.teacher_seeds must name 1 to {MAX_TEACHERS} models",
        )
        check(len(set(self.teacher_seeds)) == len(self.teacher_seeds), "distillation.teacher_seeds has a seed twice")
        check(all(0 <= s < 2**63 for s in self.teacher_seeds), "distillation.teacher_seeds must be in [0, 2**63)")
        check(
            not (self.teacher and self.teacher_recipe),
            "give distillation.teacher (trained models) or distillation.teacher_recipe (to train them), not both",
        )
        check(1 <= self.beam <= MAX_BEAM, f"distillation.beam must be in [1, {MAX_BEAM}]")
        check(1 <= self.nbest <= self.beam, f"distillation.nbest must be between 1 and distillation.beam ({self.beam})")
        check(self.max_ratio >= 1.0, f"distillation.max_ratio must be >= 1, got {self.max_ratio:g}")
        check(0.0 <= self.drop_worst < 1.0, f"distillation.drop_worst must be in [0, 1), got {self.drop_worst:g}")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.teacher_recipe)
