"""`nightshift router` (an OpenAI-compatible router in front of running replicas) and the glue
of `nightshift serve --data-parallel-size N` (N engines behind one): the engines get the serve
command's own options again, rebuilt from what was given on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nightshift.cli_errors import fail, user_errors


def router_command(
    backend: Annotated[
        list[str] | None,
        typer.Option(
            help="A replica's URL, http://HOST:PORT (repeat, or comma-separate; a trailing /v1 "
            "is fine)."
        ),
    ] = None,
    backend_dns: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST:PORT whose A/AAAA records are the replicas (a Kubernetes headless "
            "Service), resolved again at every health check (repeat)."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Bind address (loopback unless told).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    policy: Annotated[
        str,
        typer.Option(
            help="prefix (a prompt goes where its prefix is cached, else to the least busy), "
            "least-outstanding, or round-robin."
        ),
    ] = "prefix",
    prefix_block_chars: Annotated[
        int, typer.Option(help="prefix: characters per hashed prompt block.")
    ] = 64,
    min_prefix_match: Annotated[
        float, typer.Option(help="prefix: share of a prompt a replica must hold to get it.")
    ] = 0.5,
    balance_abs: Annotated[
        int,
        typer.Option(
            help="prefix: requests more than the least busy replica the holder may have in "
            "flight and still get the prompt."
        ),
    ] = 8,
    health_interval: Annotated[float, typer.Option(help="Seconds between health checks.")] = 5.0,
    health_timeout: Annotated[float, typer.Option(help="Seconds a /health may take.")] = 2.0,
    health_failures: Annotated[
        int, typer.Option(help="Failed checks in a row that take a replica out of rotation.")
    ] = 2,
    connect_timeout: Annotated[float, typer.Option(help="Seconds to connect to a replica.")] = 5.0,
    read_timeout: Annotated[
        float, typer.Option(help="Longest silence from a replica before a 504 (seconds).")
    ] = 600.0,
    max_request_bytes: Annotated[
        int, typer.Option(help="Largest request body; larger ones get a 413.", min=1)
    ] = 16 << 20,
    grace_period: Annotated[
        float, typer.Option(help="Seconds in-flight requests get after SIGTERM.")
    ] = 30.0,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require this bearer key (prefer $NIGHTSHIFT_API_KEY or a file)."),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the bearer key from this file (first line).")
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated", help="Listen beyond loopback without an API key anyway."
        ),
    ] = False,
) -> None:
    """Route OpenAI requests over several `nightshift serve` replicas (prefix-aware)."""
    from engine.router.router_config import RouterConfig
    from engine.router.serve_router import run_router
    from engine.server.auth import resolve_api_key

    with user_errors(ValueError, OSError):
        config = RouterConfig(
            backends=[b.strip() for item in backend or [] for b in item.split(",") if b.strip()],
            backend_dns=list(backend_dns or []),
            policy=policy,
            prefix_block_chars=prefix_block_chars,
            min_prefix_match=min_prefix_match,
            balance_abs=balance_abs,
            health_interval_s=health_interval,
            health_timeout_s=health_timeout,
            health_failures=health_failures,
            connect_timeout_s=connect_timeout,
            read_timeout_s=read_timeout,
            max_request_bytes=max_request_bytes,
        )
        if grace_period < 0:
            raise ValueError(f"--grace-period must be >= 0, got {grace_period}")
        key = resolve_api_key(api_key, api_key_file)
        run_router(config, host, port, key, allow_unauthenticated, grace_period)


# Options of `serve` that the engines behind the router do not get: they listen on loopback
# ports of their own, and take the key from their environment.
_NOT_FOR_ENGINES = frozenset(
    {"host", "port", "data_parallel_size", "api_key", "api_key_file", "allow_unauthenticated"}
)


def engine_args(ctx: typer.Context) -> list[str]:
    """The serve options given on the command line (or by a default map), as argv again."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name is None or name in _NOT_FOR_ENGINES or not param.opts[0].startswith("--"):
            continue
        source = ctx.get_parameter_source(name)
        if source is None or source.name == "DEFAULT":
            continue
        value = ctx.params.get(name)
        flag = param.opts[0]
        if getattr(param, "is_flag", False):
            if value:
                args.append(flag)
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
        elif getattr(param, "multiple", False):
            for v in value or ():
                args += [flag, str(v)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def serve_data_parallel_from_cli(
    ctx: typer.Context,
    size: int,
    host: str,
    port: int,
    api_key: str | None,
    allow_unauthenticated: bool,
    grace_period: float,
    device: str,
) -> None:
    from engine.router.data_parallel import DataParallelError, serve_data_parallel

    tp = int(ctx.params.get("tensor_parallel_size") or 1)
    try:
        serve_data_parallel(
            size,
            host,
            port,
            engine_args(ctx),
            api_key=api_key,
            allow_unauthenticated=allow_unauthenticated,
            grace_period=grace_period,
            device=device,
            tensor_parallel_size=tp,
        )
    except DataParallelError as e:
        raise fail(str(e), e.exit_code) from None
