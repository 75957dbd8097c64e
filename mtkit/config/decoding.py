"""How a trained model translates: the search and its sampling, where and in what precision it runs, its
vocabulary shortlist, and how `mtkit serve` serves it."""

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from mtkit.config.bounds import MAX_BATCH_TOKENS, MAX_BEAM, MAX_LENPEN, MAX_POSITIONS, MAX_TEMPERATURE, MIN_TEMPERATURE
from mtkit.config.checks import check, check_choices
from mtkit.config.setting import setting

# Translation also takes int8: int8 weights and activations in the linear layers, on the CPU (mtkit.model.quantization).
InferencePrecision = Literal["auto", "fp32", "bf16", "fp16", "int8"]
LengthPenalty = Literal["gnmt", "power"]
Engine = Literal["mtkit", "ctranslate2"]


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = setting(5, "hypotheses kept per sentence at each step")
    lenpen: float = setting(1.0, "length penalty alpha, the exponent of decode.length_penalty's divisor; 0: none")
    length_penalty: LengthPenalty = setting(
        "gnmt",
        "how a finished hypothesis's log-probability is divided by its length L (its tokens and eos): gnmt, "
        "((5 + L) / 6) ** lenpen (Wu et al., 2016; OpenNMT-py); power, L ** lenpen (transformers, CTranslate2, "
        "fairseq, Marian): choose power for a model imported from them, which the import records",
    )
    max_len_a: float = setting(1.5, "hypotheses stop at max_len_a * source_length + max_len_b tokens")
    max_len_b: int = setting(10, "the constant term of that bound")
    min_len: int = setting(0, "no eos before this many output tokens (unless max_len forces one)")
    early_stop: bool = setting(
        True,
        "also done once the best candidate ended (OpenNMT-py); False: when `beam` have (fairseq)",
    )
    batch_size: int = setting(128, "at most this many sentences per decoding batch...")
    batch_tokens: int = setting(
        40_960,
        "...and at most this many padded source tokens times the beam (the rows the search holds per sentence), so "
        "memory stays bounded at any beam: 40,960 is 8,192 source tokens at beam 5",
    )

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {
        "MAX_BEAM": ("beam",),
        "MAX_LENPEN": ("lenpen",),
        "MAX_POSITIONS": ("max_len_a", "max_len_b", "min_len"),
        "MAX_BATCH_TOKENS": ("batch_tokens", "batch_size"),
    }

    def __post_init__(self) -> None:
        check_choices(self, "decode")
        check(self.beam >= 1, "decode.beam must be >= 1")
        check(math.isfinite(self.lenpen + self.max_len_a), "decode.lenpen and decode.max_len_a must be finite")
        check(self.min_len >= 0, "decode.min_len must be >= 0")
        check(self.batch_tokens >= 1, "decode.batch_tokens must be >= 1")
        check(self.lenpen >= 0, "decode.lenpen must be >= 0")
        check(self.max_len_a >= 0 and self.max_len_b >= 1, "decode.max_len_a must be >= 0 and max_len_b >= 1")
        check(self.batch_size >= 1, "decode.batch_size must be >= 1")
        check(self.beam <= MAX_BEAM, f"decode.beam must be at most {MAX_BEAM:,}, got {self.beam:,}")
        check(self.lenpen <= MAX_LENPEN, f"decode.lenpen must be at most {MAX_LENPEN}, got {self.lenpen}")
        longest = f"at most {MAX_POSITIONS:,} (no output is longer)"
        check(self.max_len_a <= MAX_POSITIONS, f"decode.max_len_a must be {longest}, got {self.max_len_a}")
        check(self.max_len_b <= MAX_POSITIONS, f"decode.max_len_b must be {longest}, got {self.max_len_b:,}")
        check(self.min_len <= MAX_POSITIONS, f"decode.min_len must be {longest}, got {self.min_len:,}")
        most = f"at most {MAX_BATCH_TOKENS:,}"
        check(self.batch_tokens <= MAX_BATCH_TOKENS, f"decode.batch_tokens must be {most}, got {self.batch_tokens:,}")
        check(self.batch_size <= MAX_BATCH_TOKENS, f"decode.batch_size must be {most}, got {self.batch_size:,}")


@dataclass(frozen=True)
class SamplingConfig:
    """How `mtkit translate --sample` draws each next token instead of searching (back-translation,
    diverse outputs)."""

    temperature: float = setting(1.0, "< 1 sharpens the distribution, > 1 flattens it")
    top_k: int = setting(0, "sample among the k most probable tokens; 0: all")
    top_p: float = setting(1.0, "nucleus: the smallest set of tokens holding this much probability")
    seed: int = setting(1, "of the random generator: the same seed draws the same samples")

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {
        "MIN_TEMPERATURE": ("temperature",),
        "MAX_TEMPERATURE": ("temperature",),
    }

    def __post_init__(self) -> None:
        check(
            MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            f"--temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {self.temperature:g}",
        )
        check(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}")
        check(0 <= self.seed < 2**64, f"--seed must be in [0, 2**64), got {self.seed}")


@dataclass(frozen=True)
class InferenceConfig:
    """Where and how a trained model runs (`mtkit translate`, `mtkit attention`, `mtkit.load`): the defaults
    of their device, precision and engine."""

    device: str = setting("auto", "auto: cuda when available, else cpu; or cpu, cuda, cuda:N")
    precision: InferencePrecision = setting(
        "auto",
        "of the weights: auto is bf16 where the device computes it natively, else fp32; int8: CPU only",
    )
    engine: Engine = setting("mtkit", "or ctranslate2, for a folder `mtkit export` wrote")
    threads: int = setting(
        0,
        "CPU threads for one process's operations (torch's, or CTranslate2's intra_threads); 0 keeps each library's "
        "default: torch's OMP_NUM_THREADS where set, else one per core; CTranslate2's 4. Give each process its share "
        "of the cores when several translate or serve on one machine: threads that outnumber the cores wait on each "
        "other",
    )


@dataclass(frozen=True)
class ShortlistConfig:
    """How `mtkit shortlist` builds a vocabulary shortlist from training pairs (its --per-source, --frequent
    and --pairs)."""

    per_source: int = setting(
        10,
        "target candidates kept per source token: within 0.01 BLEU of the whole vocabulary on Multi30k",
    )
    frequent: int = setting(100, "most frequent target tokens, candidates for every batch")
    pairs: int = setting(200_000, "training pairs counted (the first ones): enough for the statistics, bounded memory")


@dataclass(frozen=True)
class ServeConfig:
    """How `mtkit serve` listens, batches concurrent requests and bounds what one request may ask (its --host,
    --port, --max-batch-size, --max-wait-ms, --continuous, --max-queue, --max-texts, --max-chars, --timeout,
    --receive-timeout, --max-connections, --log-format and --api-key)."""

    host: str = setting("127.0.0.1", "loopback only; 0.0.0.0 listens on every interface (then set api_key too)")
    port: int = setting(8000, "0: any free port, named in the log line that says where the server listens")
    max_batch_size: int = setting(64, "sentences of concurrent requests searched together (one request is never split)")
    max_wait_ms: float = setting(
        5.0,
        "how long the oldest sentence waits for search-mates before an idle search starts",
    )
    continuous: bool = setting(
        True,
        "requests join a search already running, and leave it as they are done (mtkit.decoding.continuous); False: "
        "each search takes the requests waiting when it starts and ends with the last of them",
    )
    max_queue: int = setting(
        1024,
        "sentences waiting beyond this are refused (503), so a burst fails fast, not by timeouts",
    )
    max_texts: int = setting(64, "texts in one request; more is refused (413)")
    max_chars: int = setting(20_000, "characters of one request's texts together; more is refused (413)")
    max_beam: int = setting(16, "the widest beam a request may ask for: its batch-mates wait for its search too")
    timeout: float = setting(30.0, "seconds a request waits for its translations before it is answered 504")
    receive_timeout: float = setting(
        10.0,
        "seconds a client may take to send a request's headers, and again its body: slower headers close the "
        "connection, a slower body is answered 408 (a client trickling bytes holds a connection no longer)",
    )
    max_connections: int = setting(
        512,
        "connections open at once; one more is answered 503 and closed (kept under the process's file limit)",
    )
    log_format: Literal["plain", "json"] = setting("plain", "json: each log line one JSON object (a request's fields)")
    api_key: str = setting(
        "",
        'required as "Authorization: Bearer KEY" on every request but /health; "": none (MTKIT_API_KEY sets it too)',
        repr=False,
    )

    bounds: ClassVar[dict[str, tuple[str, ...]]] = {"MAX_BEAM": ("max_beam",)}

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_batch_size", "max_queue", "max_texts", "max_chars", "max_connections"):
            check(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        check(1 <= self.max_beam <= MAX_BEAM, f"ServeConfig.max_beam must be in [1, {MAX_BEAM}], got {self.max_beam}")
        check(0 <= self.max_wait_ms < math.inf, f"--max-wait-ms must be a finite number >= 0, got {self.max_wait_ms}")
        check(0 < self.timeout < math.inf, f"--timeout must be a finite number > 0, got {self.timeout}")
        check(
            0 < self.receive_timeout < math.inf,
            f"--receive-timeout must be a finite number > 0, got {self.receive_timeout}",
        )
        check(self.log_format in ("plain", "json"), f"--log-format must be plain or json, got {self.log_format!r}")
