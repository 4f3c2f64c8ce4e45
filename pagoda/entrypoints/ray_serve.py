"""Ray Serve deployment of `pagoda serve`'s OpenAI app: one pagoda engine per replica.

Each replica builds the same engine and FastAPI app as `pagoda serve` (its engine in its own
process, on the GPUs Ray gives the replica) and Ray Serve routes HTTP requests across
replicas and machines, scaling between the autoscaling bounds. `serve run
pagoda.entrypoints.ray_serve:build_app_from_args model=... num_replicas=2` starts it (see
docs/distributed.md). Ray is imported only by this module: `pip install "ray[serve]"`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

try:
    from ray import serve
except ModuleNotFoundError as e:  # optional: only this module needs Ray
    raise ModuleNotFoundError(
        'the Ray Serve deployment needs Ray: pip install "ray[serve]"', name=e.name
    ) from e

from pagoda.engine.args import EngineArgs
from pagoda.engine.engine_process import start_engine
from pagoda.entrypoints.openai.api_server import build_app


@dataclasses.dataclass(frozen=True)
class RayServeOptions:
    """Replica count or autoscaling bounds, and what each replica asks Ray for."""

    served_model_name: str | None = None
    num_replicas: int | None = 1  # fixed count; None when autoscaling
    min_replicas: int | None = None  # autoscaling bounds (both, or neither)
    max_replicas: int | None = None
    target_ongoing_requests: int = 32  # per replica, what autoscaling aims for
    num_gpus: float = 0.0  # per replica (tensor_parallel_size GPUs for a TP engine)
    num_cpus: float = 1.0
    max_ongoing_requests: int = 256  # per replica, beyond which Ray queues

    def __post_init__(self) -> None:
        bounds = (self.min_replicas, self.max_replicas)
        if (bounds[0] is None) != (bounds[1] is None):
            raise ValueError("min_replicas and max_replicas go together")
        if bounds[0] is not None:
            if not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
                raise ValueError(f"need 0 <= min_replicas <= max_replicas >= 1, got {bounds}")
            if self.num_replicas not in (None, 1):
                raise ValueError("give num_replicas or min/max_replicas, not both")
        elif self.num_replicas is None or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas!r}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError("num_gpus and num_cpus must be >= 0")

    def deployment_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "ray_actor_options": {"num_gpus": self.num_gpus, "num_cpus": self.num_cpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": 10,
        }
        if self.min_replicas is not None:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class _PagodaReplica:
    """One replica: its engine and the OpenAI app over it."""

    def __init__(self, engine_args: EngineArgs, served_model_name: str | None) -> None:
        self.engine = start_engine(engine_args)
        name = served_model_name or self.engine.model_name
        self.app = build_app(self.engine, name)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine has stopped."""
        if not self.engine.is_running:
            raise RuntimeError("the pagoda engine of this replica is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def deployment(engine_args: EngineArgs, options: RayServeOptions | None = None) -> Any:
    """The bound Ray Serve application (pass it to `serve.run`)."""
    options = options or RayServeOptions()

    @serve.deployment(name="pagoda", **options.deployment_options())
    class PagodaDeployment:
        def __init__(self) -> None:
            self.replica = _PagodaReplica(engine_args, options.served_model_name)

        async def __call__(self, request: Any) -> Any:
            # Every HTTP request goes through the replica's FastAPI app.
            return await _forward(self.replica.app, request)

        def check_health(self) -> None:
            self.replica.check_health()

        def __del__(self) -> None:
            self.replica.__del__()

    return PagodaDeployment.bind()


async def _forward(app: Any, request: Any) -> Any:
    """Run a starlette `request` through the ASGI `app`; its response, streamed as it comes."""
    import asyncio

    from starlette.responses import StreamingResponse

    queue: asyncio.Queue = asyncio.Queue()
    start: asyncio.Future = asyncio.get_running_loop().create_future()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.set_result(message)
        elif message["type"] == "http.response.body":
            await queue.put(message.get("body", b""))
            if not message.get("more_body", False):
                await queue.put(None)

    task = asyncio.ensure_future(app(request.scope, request.receive, send))
    head = await start

    async def body() -> Any:
        while (chunk := await queue.get()) is not None:
            yield chunk
        await task

    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.get("headers", [])}
    headers.pop("content-length", None)  # the body streams
    return StreamingResponse(body(), status_code=head["status"], headers=headers)


_OPTION_NAMES = {f.name for f in dataclasses.fields(RayServeOptions)}


def build_app_from_args(args: dict[str, str]) -> Any:
    """`serve run pagoda.entrypoints.ray_serve:build_app_from_args key=value ...`: EngineArgs
    fields (model, dtype, max_model_len, tensor_parallel_size, ...) and `RayServeOptions`
    fields, as strings; an unknown key is a ValueError listing the known ones."""
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    engine_kwargs, option_kwargs = {}, {}
    for key, value in args.items():
        if key in _OPTION_NAMES:
            option_kwargs[key] = _parse(value, RayServeOptions.__dataclass_fields__[key].type)
        elif key in engine_fields:
            engine_kwargs[key] = _parse(value, engine_fields[key].type)
        else:
            known = sorted(_OPTION_NAMES | set(engine_fields))
            raise ValueError(f"unknown argument {key!r}; known: {', '.join(known)}")
    return deployment(EngineArgs(**engine_kwargs), RayServeOptions(**option_kwargs))


def _parse(value: Any, annotation: Any) -> Any:
    """A `key=value` string as the field's type (int, float, bool or str; "none" is None)."""
    if not isinstance(value, str):
        return value
    text = str(annotation)
    if value.lower() == "none" and "None" in text:
        return None
    if text.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    for kind, cast in (("int", int), ("float", float)):
        if text.startswith(kind):
            return cast(value)
    return value
