"""Workflow `openenv`: an OpenEnv environment defined here (a guess-the-sum game over 1-3
steps), served on 127.0.0.1 by OpenEnv's own `create_app` under uvicorn and driven through
OpenEnv's own client: the tokens are the engine's and the observations', the rewards are the
environment's, observations are masked, a server that is down or silent fails the group in
time, and a short `astra run` trains on it."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

core = pytest.importorskip("openenv.core", reason="the openenv package (dev extra)")
uvicorn = pytest.importorskip("uvicorn")

from astra.cli import main as astra_cli  # noqa: E402
from astra.engine.tiny import load_model  # noqa: E402
from astra.engine.torch_engine import TorchEngine  # noqa: E402
from astra.raas.backend import GroupSpec  # noqa: E402
from astra.raas.engine_backend import EngineBackend  # noqa: E402
from astra.run import layout  # noqa: E402
from astra.run.layout import RunDir  # noqa: E402
from astra.run.recipe import RecipeError, load_recipe  # noqa: E402
from astra.workflows.openenv_env import observation_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEN: dict[str, dict[str, Any]] = {}  # episode id -> what the environment saw and gave


class GuessAction(core.Action):
    message: str


class GuessObservation(core.Observation):
    prompt: str = ""


class GuessEnv(core.Environment):
    """Says the prompt; each guess scores 1 when it is the record's answer, else 0.1 x the
    step; done on a right guess or after the record's `steps` (default 1) guesses. A record
    with `stall` makes every step take that many seconds."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = core.State()
        self.answer, self.steps, self.stall, self.log = "", 1, 0.0, {}

    def reset(self, seed=None, episode_id=None, prompt="", record=None, **kw):  # type: ignore[override]
        record = record or {}
        self._state = core.State(episode_id=episode_id, step_count=0)
        self.answer, self.steps = str(record.get("answer", "")), int(record.get("steps", 1))
        self.stall = float(record.get("stall", 0))
        self.log = SEEN[str(episode_id)] = {"observations": [prompt], "actions": [], "rewards": []}
        return GuessObservation(prompt=prompt)

    async def step_async(self, action, timeout_s=None, **kw):  # type: ignore[override]
        await asyncio.sleep(self.stall)
        return self.step(action)

    def step(self, action, timeout_s=None, **kw):  # type: ignore[override]
        self._state.step_count += 1
        n = self._state.step_count
        right = action.message.strip() == self.answer
        reward = 1.0 if right else round(0.1 * n, 3)
        done = right or n >= self.steps
        prompt = "" if done else f"\nwrong ({n}), again: "
        self.log["actions"].append(action.message)
        self.log["rewards"].append(reward)
        if not done:
            self.log["observations"].append(prompt)
        return GuessObservation(prompt=prompt, reward=reward, done=done)

    @property
    def state(self):  # type: ignore[override]
        return self._state


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    app = core.create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=64)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_ping_interval=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def group(data: dict[str, Any], n: int = 2) -> GroupSpec:
    return GroupSpec(
        group_id=f"g/{time.monotonic_ns()}", workflow="openenv", policy_ids=("policy",),
        num_samples=n, max_new_tokens=4, temperature=1.0, seed=7, prompt_text="12+34=",
        data=data,
    )  # fmt: skip


def run_group(data: dict[str, Any], **options: Any) -> tuple[list, GroupSpec, Any, float]:
    async def body() -> tuple[list, GroupSpec, Any, float]:
        model, tok = load_model("tiny")
        engine = TorchEngine({"policy": (model, tok)})
        backend = EngineBackend(engine, ["openenv"], workflow_options={"openenv": options})
        g = group(data)
        try:
            started = time.monotonic()
            out = await backend.generate(g, {"policy": 0})
            return out, g, tok, time.monotonic() - started
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(body(), 120))


def runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def test_a_three_step_game_is_one_sequence_with_the_observations_masked(env_url) -> None:
    out, g, tok, _ = run_group({"answer": "no such sum", "steps": 3}, url=env_url, max_turns=5)
    assert [t.error for t in out] == [None, None]
    for t in out:
        seen = SEEN[f"{g.group_id}/{t.sample_index}"]
        assert t.reward == pytest.approx(sum(seen["rewards"])) == pytest.approx(0.6)
        assert t.metadata["turns"] == 3 and t.metadata["ended"] == "done"
        (seq,) = t.sequences  # each turn continues the last one's tokens
        ids, mask = seq.token_ids.tolist(), seq.loss_mask.tolist()
        # the context is exactly the environment's observations, tokenized; in between,
        # the model's tokens, which decode to the actions the environment received
        context = [ids[a:b] for a, b in runs(mask, 0)]
        model = [ids[a:b] for a, b in runs(mask, 1)]
        assert context == [tok.encode(o) for o in seen["observations"]]
        assert [tok.decode(m) for m in model] == seen["actions"]
        assert seq.prompt_length == len(tok.encode("12+34="))
        assert (seq.weight_versions[seq.loss_mask == 1] == 0).all()
        assert (seq.weight_versions[seq.loss_mask == 0] == -1).all()
        assert (seq.logprobs[seq.loss_mask == 1] < 0).all()
        assert (seq.logprobs[seq.loss_mask == 0] == 0).all()


def test_the_last_reward_and_the_turn_limit(env_url) -> None:
    out, g, _, _ = run_group(
        {"answer": "no such sum", "steps": 3}, url=env_url, max_turns=2, reward_mode="last"
    )
    for t in out:
        assert t.error is None and t.metadata["ended"] == "max_turns"
        assert t.reward == SEEN[f"{g.group_id}/{t.sample_index}"]["rewards"][-1] == 0.2


def test_an_action_parser_named_in_the_options_makes_the_action(env_url) -> None:
    ref = f"{__name__}:shouted"
    out, g, _, _ = run_group({"answer": "x"}, url=env_url, action=ref)
    for t in out:
        assert t.error is None
        assert SEEN[f"{g.group_id}/{t.sample_index}"]["actions"][0].startswith("SAID:")


def shouted(text: str) -> dict[str, str]:
    return {"message": "SAID:" + text}


def test_a_server_that_is_down_fails_the_group_in_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    out, _, _, took = run_group({}, url=f"http://127.0.0.1:{port}", timeout_s=3)
    assert all("workflow_options.openenv.url" in (t.error or "") for t in out), out
    assert took < 20


def test_a_silent_environment_fails_the_group_at_its_timeout(env_url) -> None:
    out, _, _, took = run_group({"stall": 30}, url=env_url, timeout_s=1)
    assert all("within 1.0 s" in (t.error or "") for t in out), [t.error for t in out]
    assert took < 20


def test_an_action_the_environment_refuses_fails_the_sample(env_url) -> None:
    out, _, _, _ = run_group({"answer": "x"}, url=env_url, action_field="guess")
    assert all("failed the action" in (t.error or "") for t in out), [t.error for t in out]


def test_observations_render_to_their_text() -> None:
    assert observation_text({"prompt": "2+2=", "metadata": {}}) == "2+2="
    assert observation_text(GuessObservation(prompt="hi", reward=1.0)) == "hi"
    assert observation_text({"a": 1, "text": "t"}) == "t"
    assert json.loads(observation_text({"a": 1, "b": [2]})) == {"a": 1, "b": [2]}


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"url": "localhost:8000"}, "openenv.url"),
        ({"url": "http://x", "client": "no_such_module:Env"}, "openenv.client"),
        ({"url": "http://x", "action": "json:no_such_fn"}, "openenv.action"),
        ({"url": "http://x", "reward_mode": "max"}, "openenv.reward_mode"),
        ({"url": "http://x", "max_turn": 3}, "unknown option"),
    ],
)
def test_a_recipe_with_bad_openenv_options_is_refused_naming_the_key(options, says) -> None:
    with pytest.raises(RecipeError, match=says):
        load_recipe(
            ROOT / "configs/recipes/default.yaml",
            [
                "streams.0.workflow=openenv",
                f"raas=[{{workflow_options: {{openenv: {json.dumps(options)}}}}}]",
            ],
        )


def test_the_recipe_s_options_reach_astra_serve_raas(tmp_path: Path) -> None:
    opts = {"url": "http://127.0.0.1:9", "max_turns": 2}
    r = load_recipe(
        ROOT / "configs/recipes/default.yaml",
        [
            "streams.0.workflow=openenv",
            f"raas=[{{workflow_options: {{openenv: {json.dumps(opts)}}}}}]",
        ],
    )
    args = layout.raas_command(r, 0, RunDir(tmp_path / "run"), "127.0.0.1:1")
    serve = astra_cli.commands["serve"].commands["raas"]
    params = serve.make_context("raas", list(args[5:])).params
    assert json.loads(params["workflow_options"]) == {"openenv": opts}
    assert "openenv" in params["workflows"]


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_a_short_run_trains_on_the_environment(env_url, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    raas = json.dumps([{"capacity": 8, "workflow_options": {"openenv": {"url": env_url}}}])
    cmd = [sys.executable, "-m", "astra.run", str(ROOT / "configs/recipes/default.yaml")]
    cmd += ["--run-dir", str(run_dir)]
    for override in (
        "streams.0.workflow=openenv",
        f"raas={raas}",
        "trainer.num_steps=2",
        "trainer.batch_groups=2",
        "warmup.steps=20",
        "eval.size=8",
    ):
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["steps_per_policy"] == {"policy": 2} and s["groups_trained"] == 2 * 2
    assert s["counters"]["failed_groups"] == 0, s["counters"]
