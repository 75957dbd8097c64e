"""Several models behind one server: requests routed by model or by languages, models loaded at their first request
and evicted least recently used under --max-loaded, each model's queue apart; the models file; bad input."""

from __future__ import annotations

import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import invoke, one_line_error
from live_server import AUTH, KEY, Countdown, ScriptedScorer, Server
from prometheus_client.parser import text_string_to_metric_families

import mtkit
from mtkit.config import ConfigError, DecodeConfig, ServeConfig
from mtkit.serving.batcher import Batcher, Refused
from mtkit.serving.model_specs import read_models_file, specs_of
from mtkit.serving.models import Loaded, ModelCard, ModelPool, ModelSpec
from mtkit.serving.searches import ModelSteps, Scoring, Translating, make_batcher, model_of

LINES = ["A dog runs.", "Two men in a boat.", "A woman sings.", "", "A cat."]


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()):
                return sample.value
    return 0.0


def translate(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/translate", json=body, headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def expected(trained_run, multilingual_run) -> dict[str, list[str]]:
    """The library's translations of LINES: the bilingual model's, and the multilingual one's into de and fr."""
    bilingual, multilingual = mtkit.load(trained_run, device="cpu"), mtkit.load(multilingual_run, device="cpu")
    return {
        "en-de": bilingual.translate(LINES),
        "multi:de": multilingual.translate(LINES, tgt_lang="de"),
        "multi:fr": multilingual.translate(LINES, tgt_lang="fr"),
    }


@pytest.fixture(scope="module")
def two_models(trained_run, multilingual_run, tmp_path_factory):
    """A server of the bilingual model (en-de) and the multilingual one (en->de, en->fr), one in memory at a time."""
    options = ["--model", f"en-de={trained_run}", "--model", f"multi={multilingual_run}", "--max-loaded", "1"]
    running = Server(None, tmp_path_factory.mktemp("models") / "stderr", *options, env={"MTKIT_API_KEY": KEY})
    yield running
    assert running.stop() == 0


def test_requests_go_to_the_model_they_name_or_the_first_that_translates_their_languages(two_models, expected):
    routed = {
        "en-de": {"model": "en-de"},
        "multi:fr": {"tgt_lang": "fr"},  # only the multilingual model translates into fr
        "multi:de": {"model": "multi", "tgt_lang": "de"},
    }
    for name, fields in routed.items():
        response = translate(two_models.url, {"text": LINES, **fields})
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == expected[name], name
    by_languages = translate(two_models.url, {"text": LINES, "src_lang": "en", "tgt_lang": "de"})
    assert by_languages.json()["translations"] == expected["en-de"]  # the first of the two that translate en->de


def test_one_model_in_memory_at_a_time_each_loaded_again_when_asked_for(two_models, expected):
    loads = {name: metric(two_models.url, "mtkit_model_loads_total", model=name) for name in ("en-de", "multi")}
    for _ in range(2):
        for name, fields in (("en-de", {"model": "en-de"}), ("multi", {"model": "multi", "tgt_lang": "fr"})):
            response = translate(two_models.url, {"text": LINES, **fields})
            assert response.json()["translations"] == expected["en-de" if name == "en-de" else "multi:fr"]
            models = httpx.get(two_models.url + "/v1/models", headers=AUTH).json()["models"]
            assert [model["name"] for model in models if model["loaded"]] == [name]
            assert metric(two_models.url, "mtkit_models_loaded") == 1
    moved = {
        name: metric(two_models.url, "mtkit_model_loads_total", model=name) - before for name, before in loads.items()
    }
    assert moved["en-de"] >= 1 and moved["multi"] == 2  # en-de may have been in memory already
    for name in loads:
        assert metric(two_models.url, "mtkit_model_evictions_total", model=name) >= 1


def test_concurrent_requests_for_both_models_each_get_their_models_answers(two_models, expected):
    fields = {
        "en-de": {"model": "en-de"},
        "multi:de": {"model": "multi", "tgt_lang": "de"},
        "multi:fr": {"tgt_lang": "fr"},
    }

    def one(i: int) -> bool:
        name = list(fields)[i % 3]
        line = i % len(LINES)
        response = translate(two_models.url, {"text": LINES[line], **fields[name]})
        return response.status_code == 200 and response.json()["translations"] == [expected[name][line]]

    with ThreadPoolExecutor(12) as pool:
        assert all(pool.map(one, range(36)))


def test_models_lists_each_model_its_directions_and_whether_it_is_in_memory(two_models):
    listed = httpx.get(two_models.url + "/v1/models", headers=AUTH).json()["models"]
    assert [model["name"] for model in listed] == ["en-de", "multi"]
    assert listed[0]["directions"] == [{"source": "en", "target": "de"}]
    assert listed[1]["directions"] == [{"source": "en", "target": "de"}, {"source": "en", "target": "fr"}]
    assert listed[1]["languages"] is None  # several targets: a request says which
    assert sum(model["loaded"] for model in listed) == 1
    assert "/" not in str([model["name"] for model in listed])


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"text": "A dog.", "model": "nope"}, "this server has no model 'nope'; it serves en-de, multi"),
        ({"text": "A dog.", "model": "x" * 10_000}, "... (10,000 characters)"),
        ({"text": "A dog.", "model": 5}, "model: Input should be a valid string"),
        ({"text": "A dog."}, "this server serves 2 models (en-de, multi): say which with model"),
        ({"text": "A dog.", "tgt_lang": "cs"}, "no model of this server translates into 'cs'"),
        ({"text": "A dog.", "src_lang": "fr", "tgt_lang": "de"}, "no model of this server translates 'fr' into 'de'"),
        ({"text": "A dog.", "model": "en-de", "tgt_lang": "fr"}, "this model does not translate into 'fr'"),
        ({"text": "A dog.", "model": "en-de", "adapter": "legal"}, "this server has no adapter 'legal'"),
    ],
)
def test_a_request_for_no_model_served_is_422_saying_why(two_models, body, problem):
    response = translate(two_models.url, body)
    assert response.status_code == 422 and problem in response.json()["detail"], response.text
    assert len(response.text) < 600


def test_scores_come_from_the_model_named(two_models, trained_run):
    sources, targets = LINES[:3], ["Ein Hund.", "Zwei Männer.", "Eine Frau."]
    response = httpx.post(
        two_models.url + "/v1/score", json={"source": sources, "target": targets, "model": "en-de"}, headers=AUTH
    )
    library = list(mtkit.load(trained_run, device="cpu").score(sources, targets))
    assert [score["logprob"] for score in response.json()["scores"]] == pytest.approx(
        [score.logprob for score in library], abs=1e-4
    )


def test_a_models_file_names_the_models_their_adapters_and_max_loaded(tmp_path, trained_run, multilingual_run):
    toml = tmp_path / "models.toml"
    toml.write_text(
        f'max_loaded = 1\n[[models]]\nname = "en-de"\npath = "{trained_run}"\n'
        f'[[models]]\nname = "multi"\npath = "multi-run"\n'
    )
    (tmp_path / "multi-run").symlink_to(multilingual_run)
    specs, max_loaded = read_models_file(toml)
    assert max_loaded == 1
    assert specs == [ModelSpec("en-de", trained_run), ModelSpec("multi", tmp_path / "multi-run")]  # by the file
    as_yaml = tmp_path / "models.yaml"
    as_yaml.write_text(yaml.safe_dump({"models": [{"name": "a", "path": "x", "adapters": {"legal": "l.safetensors"}}]}))
    assert read_models_file(as_yaml) == ([ModelSpec("a", tmp_path / "x", {"legal": tmp_path / "l.safetensors"})], None)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("models = 3", "models must be a list of 1 to 256 models"),
        ("[[models]]\nname = 'a'", "models[0] has no 'path'"),
        ("[[models]]\nname = 'a/b'\npath = 'x'", "models[0].name: letters, digits"),
        ("[[models]]\nname = 'a'\npath = 'x'\n[[models]]\nname = 'a'\npath = 'y'", "'a' names an earlier model too"),
        ("[[models]]\nname = 'a'\npath = 'x'\nrm = 1", "models[0] has unknown key(s) 'rm'"),
        ("max_loaded = -1\n[[models]]\nname = 'a'\npath = 'x'", "max_loaded must be at least 0"),
        ("[[models]]\nname = 'a'\npath = 'x'\nadapters = { '../x' = 'y' }", "is no adapter name"),
        ("[[models", "not readable TOML"),
        ("surprise = 1\nmodels = []", "unknown key(s) 'surprise'"),
    ],
)
def test_a_bad_models_file_is_a_one_line_error_naming_it(tmp_path, content, problem):
    path = tmp_path / "models.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match="models.toml: ") as raised:
        read_models_file(path)
    assert problem in str(raised.value)
    result = invoke("serve", "--models", path, "--port", 0)
    one_line_error(result, problem)


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ([], "give a MODEL to serve, --model NAME=PATH for several, or --models FILE"),
        (["--model", "a"], "--model takes NAME=PATH"),
        (["--model", "a=x", "--model", "a=y"], "--model gives each NAME once"),
        (["run", "--model", "a=x"], "give one MODEL, or several with --model NAME=PATH, not both"),
        (["--model", "a=x", "--model", "b=y", "--adapter", "l=z"], "--adapter goes with one MODEL"),
        (["--model", "a=no/such/run"], "checkpoint not found"),
        (["--model", "a=x", "--max-loaded", "-1"], "--max-loaded must be >= 0"),
    ],
)
def test_bad_model_options_are_one_line_errors_before_anything_loads(tmp_path, arguments, problem):
    one_line_error(invoke("serve", *arguments, "--port", 0), problem)


def test_the_command_line_names_a_lone_model_by_its_folder():
    assert specs_of("runs/m30k/best", [], ["legal=x"]) == [
        ModelSpec("m30k", Path("runs/m30k/best"), {"legal": Path("x")})
    ]


# -- the pool's admission and eviction, with models that are names and searches that hold them ------------------------


class Holding(Countdown):
    """A continuous search over one model's translator that keeps it while it has lines: each line is done after
    as many steps as it has characters, as its model's name and the line upper-cased."""

    def __init__(self, translators: dict) -> None:
        super().__init__([])
        self.model = translators[None]

    def step(self) -> list:
        return [(key, f"{self.model.name}:{text}") for key, text in super().step()]


class Weights:
    """What a loaded model holds; the test counts those alive."""

    def __init__(self, name: str) -> None:
        self.name = name


def card(name: str) -> ModelCard:
    return ModelCard(name, None, DecodeConfig(), aligns=False, adapters=[])


@pytest.mark.parametrize("max_loaded", [1, 2])
def test_the_pool_never_holds_more_than_max_loaded_models_and_answers_every_request(max_loaded):
    alive: weakref.WeakSet = weakref.WeakSet()
    most = [0]
    names = ["a", "b", "c"]

    def load(spec: ModelSpec) -> Loaded:
        most[0] = max(most[0], len(alive) + 1)
        weights = Weights(spec.name)
        alive.add(weights)
        return Loaded({None: weights}, [], "continuous")

    pool, batcher = pool_and_batcher(names, max_loaded, load, max_wait_s=0.0)
    batcher.start()
    rng = random.Random(1)
    try:
        jobs = [(rng.choice(names), [f"L{i}.{j}" for j in range(rng.randint(1, 4))]) for i in range(120)]
        futures = []
        for name, lines in jobs:
            futures.append(batcher.submit(lines, Translating(name, 1)))
            time.sleep(rng.random() * 0.002)
        for (name, lines), future in zip(jobs, futures):
            assert future.result(timeout=60) == [f"{name}:{line.upper()}" for line in lines]
    finally:
        batcher.close()
    assert most[0] <= max_loaded  # counted before each load: weights of an evicted model are gone by then
    assert len(pool.loaded) <= max_loaded


def test_a_models_full_queue_refuses_its_own_requests_only():
    batcher = Batcher(lambda lines, options: lines, max_batch_size=2, max_wait_s=60.0, max_queue=3, queue_of=model_of)
    batcher.submit(["1", "2", "3"], Translating("a", 1))  # a's queue is full, and waits for batch-mates
    with pytest.raises(Refused, match="3 sentences are waiting already"):
        batcher.submit(["4"], Translating("a", 1))
    assert batcher.submit(["x"], Translating("b", 1)) is not None
    assert (batcher.pending("a"), batcher.pending("b")) == (3, 1)
    batcher.close()


def pool_and_batcher(names: list[str], max_loaded: int, load, max_wait_s: float = 0.05) -> tuple[ModelPool, Batcher]:
    """A pool of models ``names`` and the batcher that admits their requests through it, searching with ``Holding``."""
    pool = ModelPool([ModelSpec(name, Path(name)) for name in names], [card(name) for name in names], load, max_loaded)
    batcher = Batcher(
        lambda lines, options: [],
        max_batch_size=8,
        max_wait_s=max_wait_s,
        max_queue=1000,
        open_search=lambda options: Holding(pool.translators(options.model)),
        queue_of=model_of,
        admit=pool.admit,
    )
    return pool, batcher


def test_requests_for_an_idle_model_in_memory_and_one_that_needs_its_room_both_get_answers():
    pool, batcher = pool_and_batcher(["a", "c"], 1, lambda spec: Loaded({None: Weights(spec.name)}, [], "continuous"))
    pool.translators("a")  # in memory and idle; both requests are due in the same round
    first, second = batcher.submit(["x"], Translating("a", 1)), batcher.submit(["y"], Translating("c", 1))
    batcher.start()
    try:
        assert first.result(timeout=10) == ["a:X"] and second.result(timeout=10) == ["c:Y"]
    finally:
        batcher.close()


def test_a_model_that_fails_to_load_fails_its_requests_without_loading_again():
    tries = []

    def load(spec: ModelSpec) -> Loaded:
        tries.append(spec.name)
        if spec.name == "broken":
            raise ConfigError("broken: checkpoint not found")
        return Loaded({None: Weights(spec.name)}, [], "continuous")

    pool, batcher = pool_and_batcher(["a", "broken"], 1, load)
    batcher.start()
    try:
        assert batcher.submit(["x"], Translating("a", 1)).result(timeout=10) == ["a:X"]
        failing = [batcher.submit([f"y{i}"], Translating("broken", 1)) for i in range(3)]
        for future in failing:
            with pytest.raises(Exception, match="checkpoint not found"):
                future.result(timeout=10)
        assert batcher.submit(["z"], Translating("a", 1)).result(timeout=10) == ["a:Z"]
    finally:
        batcher.close()
    assert tries == ["a", "broken", "a"]  # tried once: "a" made room for that try alone, and came back


def test_a_model_told_its_languages_by_tokens_is_not_routed_a_translation_into_its_source():
    from mtkit.config import DataConfig

    data = DataConfig(src_lang="en", tgt_lang="de", languages=("en", "de", "fr"), language_token="__{lang}__")
    nllb = ModelCard("nllb", data, DecodeConfig(), aligns=True, adapters=[])
    assert nllb.translates(None, "fr") and nllb.translates("fr", "de")
    assert not nllb.translates(None, "en") and not nllb.translates("de", "de") and not nllb.translates("cs", "de")


def test_a_models_file_may_share_adapters_by_a_yaml_anchor_and_bounds_them(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n  - {name: a, path: x, adapters: &shared {legal: l.safetensors}}\n"
        "  - {name: b, path: y, adapters: *shared}\n"
    )
    specs, _ = read_models_file(path)
    assert [spec.adapters for spec in specs] == [{"legal": tmp_path / "l.safetensors"}] * 2
    many = {f"adapter{i}": "x" for i in range(65)}
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "path": "x", "adapters": many}]}))
    with pytest.raises(ConfigError, match="65 adapters; a model has at most 64"):
        read_models_file(path)
    path.write_text(yaml.safe_dump({"models": [{"name": "a" * 5000, "path": "x"}]}))
    with pytest.raises(ConfigError) as raised:
        read_models_file(path)
    assert len(str(raised.value)) < 400
    path.write_text(yaml.safe_dump({"models": [{"name": "a", "path": ""}]}))
    with pytest.raises(ConfigError, match=r"models\[0\].path is empty"):
        read_models_file(path)


def test_a_model_loaded_again_renews_its_card_from_what_was_loaded():
    class Changed(Weights):
        data, decode = None, DecodeConfig(beam=7)

    pool, _ = pool_and_batcher(["a", "b"], 1, lambda spec: Loaded({None: Changed(spec.name)}, [], "continuous"))
    assert pool.cards["a"].decode.beam != 7
    pool.translators("a")
    assert pool.cards["a"].decode.beam == 7 and pool.cards["a"].context["beam"] == 7


class Recording(Holding):
    """``Holding``, noting the thread and the time span of each of its steps."""

    spans: list = []

    def step(self) -> list:
        start = time.monotonic()
        time.sleep(0.02)
        done = super().step()
        Recording.spans.append((self.model.name, threading.current_thread().name, start, time.monotonic()))
        return done


def test_the_steps_of_several_models_run_at_once_and_each_models_in_turn():
    names = ["a", "b", "c"]
    pool = ModelPool(
        [ModelSpec(name, Path(name)) for name in names], [card(name) for name in names],
        lambda spec: Loaded({None: Weights(spec.name)}, [], "continuous"),
    )  # fmt: skip
    Recording.spans = []
    batcher = Batcher(
        lambda lines, options: [], 8, 0.0, 1000, open_search=lambda options: Recording(pool.translators(options.model)),
        queue_of=model_of, admit=pool.admit, step_queues=ModelSteps(),
    )  # fmt: skip
    alone = batcher.submit(["solo"], Translating("a", 1))
    batcher.start()
    try:
        assert alone.result(timeout=10) == ["a:SOLO"]
        solo_threads = {thread for _, thread, _, _ in Recording.spans}
        futures = [batcher.submit([f"{name}{i}"], Translating(name, 1)) for i in range(3) for name in names]
        assert [future.result(timeout=30) for future in futures] == [
            [f"{name}:{name.upper()}{i}"] for i in range(3) for name in names
        ]
    finally:
        batcher.close()
    assert solo_threads == {"mtkit-batcher"}  # one model alone: stepped in the batcher's own thread
    together = Recording.spans[len(solo_threads) :]
    overlaps = {
        (one[0], other[0])
        for one in together
        for other in together
        if one[0] < other[0] and one[2] < other[3] and other[2] < one[3]
    }
    assert overlaps  # steps of different models ran at the same time
    for name in names:
        mine = sorted((start, end) for model, _, start, end in together if model == name)
        assert all(end <= later for (_, end), (later, _) in zip(mine, mine[1:]))  # one model's steps in turn


def test_models_load_in_the_batchers_thread_even_for_scoring_steps_that_run_at_once():
    loaded_in = []

    def load(spec: ModelSpec) -> Loaded:
        loaded_in.append(threading.current_thread().name)
        return Loaded({None: ScriptedScorer()}, [], "whole batches")

    names = ["a", "b"]
    pool = ModelPool([ModelSpec(name, Path(name)) for name in names], [card(name) for name in names], load)
    batcher = make_batcher(pool.translators, ServeConfig(max_wait_ms=0), pool.admit)
    scoring = [batcher.submit([("A dog.", "Ein Hund.")], Scoring(name, None, False)) for name in names]
    batcher.start()
    try:
        assert [future.result(timeout=10)[0].tokens for future in scoring] == [10, 10]
    finally:
        batcher.close()
    assert loaded_in == ["mtkit-batcher", "mtkit-batcher"]


def test_the_first_request_to_a_model_loaded_for_it_counts_its_tokens(two_models):
    assert translate(two_models.url, {"text": LINES, "model": "en-de"}).status_code == 200  # multi is evicted
    loads = metric(two_models.url, "mtkit_model_loads_total", model="multi")
    counted = metric(two_models.url, "mtkit_tokens_total", model="multi", side="source")
    assert translate(two_models.url, {"text": LINES, "model": "multi", "tgt_lang": "fr"}).status_code == 200
    assert metric(two_models.url, "mtkit_model_loads_total", model="multi") == loads + 1
    assert metric(two_models.url, "mtkit_tokens_total", model="multi", side="source") > counted
