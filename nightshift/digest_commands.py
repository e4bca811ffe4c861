"""`nightshift digest run|schedule|render` and `nightshift db upgrade|downgrade|current`.

Errors a user can fix end in one line naming the problem and a non-zero exit code: 1 the run
failed, 2 bad arguments or configuration, 3 the digest was published with some papers failed."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from digest.run_report import EXIT_FAILED, EXIT_USAGE

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from digest.delivery import DeliveryConfig
    from digest.embeddings_client import EmbeddingsConfig
    from digest.pipeline import RunOptions
    from digest.profile import ReaderProfile
    from digest.run_cost import Pricing
    from digest.run_report import RunReport

T = TypeVar("T")

log = logging.getLogger("nightshift")

digest_app = typer.Typer(no_args_is_help=True, help="The nightly paper digest.")
db_app = typer.Typer(no_args_is_help=True, help="Digest database migrations (Alembic).")

SAMPLE = "examples/papers-2026-03-sample.jsonl"
# The local server's speculation: summaries copy the abstract's phrases, which prompt lookup
# predicts (docs/PERFORMANCE.md: 6 sample papers, 42 s -> 35 s, identical output).
LOCAL_SPECULATION = ("--speculative", "ngram")

DateOpt = Annotated[
    str | None,
    typer.Option(
        "--date",
        help="The digest's date, YYYY-MM-DD. Default: yesterday (UTC) for --source arxiv, "
        "which then takes what arXiv announced since the last run (a watermark in the store); "
        "today (UTC) otherwise. Given with --source arxiv: that day's submissions that no "
        "other digest lists (a backfill).",
    ),
]
StoredDateOpt = Annotated[
    str | None,
    typer.Option("--date", help="A stored digest's date, YYYY-MM-DD. Default: the newest."),
]
LinkUrlOpt = Annotated[
    str | None,
    typer.Option(
        envvar="NIGHTSHIFT_SITE_URL",
        help="Public URL of the published pages: the message links to the digest's page.",
    ),
]
CategoriesOpt = Annotated[
    str | None,
    typer.Option(
        help="arXiv categories, comma-separated (default cs.CL,cs.LG). With --source FILE: keep "
        "only the file's papers in any of them (default: every paper in the file)."
    ),
]
MaxPapersOpt = Annotated[
    int | None,
    typer.Option(
        help="Take at most this many papers (arxiv nightly: the oldest new ones; the rest wait "
        "for the next run)."
    ),
]
DEFAULT_OVERLAP_DAYS = 3.0
OverlapOpt = Annotated[
    float,
    typer.Option(
        help="arxiv nightly: days before the watermark that the query reaches back, for papers "
        "arXiv announces late (held in moderation); papers already listed are not taken twice."
    ),
]
SourceOpt = Annotated[str, typer.Option(help="arxiv (query API), rss (announcements), or FILE.")]
InputOpt = Annotated[str, typer.Option("--input", help="abstract or fulltext (arXiv HTML).")]
EndpointOpt = Annotated[
    str,
    typer.Option(
        help="'local' (start our server), an OpenAI-compatible base URL, or several "
        "comma-separated serving the same model (each paper's calls go to one of them)."
    ),
]
ModelOpt = Annotated[str | None, typer.Option(help="Model name (required with a URL).")]
KeyEnvOpt = Annotated[
    str | None, typer.Option(help="Environment variable holding the endpoint's API key.")
]
ConcurrencyOpt = Annotated[int, typer.Option(help="Model requests in flight.")]
DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Database URL. Default: $NIGHTSHIFT_DATABASE_URL or SQLite."),
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Output folder. Default: $NIGHTSHIFT_DIGEST_DIR or cache dir."),
]
SiteUrlOpt = Annotated[
    str | None,
    typer.Option(
        envvar="NIGHTSHIFT_SITE_URL",
        help="Public URL of --out: absolute links and stable ids in the feed. Set it once.",
    ),
]
CrossOpt = Annotated[bool, typer.Option(help="rss: keep cross-listed announcements too.")]
MaxCharsOpt = Annotated[int, typer.Option(help="fulltext: truncate the text to this length.")]
RepublishedOpt = Annotated[
    str,
    typer.Option(
        help="A paper an earlier digest published: 'mark' lists it again with a link to that "
        "digest, 'skip' leaves it out."
    ),
]
LocalModelOpt = Annotated[
    str,
    typer.Option(help="local: the model the local server loads, 'default' or an HF folder."),
]
ViaOpt = Annotated[
    str,
    typer.Option(
        help="How the model is called: stream (each call streamed) or batch (the night as one "
        "OpenAI Batch API batch, polled; the local server serves it, as can a cloud provider)."
    ),
]
LocalSpecOpt = Annotated[
    bool,
    typer.Option(
        help="local: n-gram speculative decoding in the local server (same greedy output, "
        "faster summaries)."
    ),
]
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        envvar="NIGHTSHIFT_PROFILE",
        help="Reader profile (`digest profile`) that ranks the papers: 'for you' first, model "
        "calls to the best first, --max-papers takes the top. Default: "
        "$NIGHTSHIFT_HOME/profile.json when it exists.",
    ),
]
EmbeddingsOpt = Annotated[
    str | None,
    typer.Option(
        help="With a profile: an OpenAI-compatible base URL whose /embeddings adds embedding "
        "similarity to the ranking (needs --embeddings-model)."
    ),
]
EmbeddingsModelOpt = Annotated[str | None, typer.Option(help="The --embeddings-endpoint's model.")]
EmailToOpt = Annotated[
    str | None,
    typer.Option(
        envvar="NIGHTSHIFT_DIGEST_EMAIL_TO",
        help="Email the digest to these addresses (comma-separated) over SMTP with STARTTLS "
        "or implicit TLS; server, TLS and login from NIGHTSHIFT_SMTP_* (docs/OPERATIONS.md).",
    ),
]
WebhookOpt = Annotated[
    str | None,
    typer.Option(
        envvar="NIGHTSHIFT_DIGEST_WEBHOOK_URL",
        help="POST the digest as Slack-compatible JSON to this URL (a secret: prefer the "
        "environment variable).",
    ),
]
PriceOpt = Annotated[
    str | None,
    typer.Option(
        "--price-per-mtok",
        metavar="IN,OUT",
        help="Cost per night in the run report: USD per million prompt and completion tokens "
        "(a cloud endpoint), e.g. 0.15,0.60.",
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        help="Cost per night in the run report: the self-hosted server's GPU (a capacity "
        "catalogue name), priced per GPU-hour of the run."
    ),
]
GpusOpt = Annotated[int, typer.Option(help="GPUs the server holds (with --gpu).")]
GpuPriceOpt = Annotated[
    float | None,
    typer.Option(help="USD per GPU-hour (with --gpu); default the catalogue's assumed price."),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="local: the local server's torch CPU threads (`serve --threads`; default: "
        "$OMP_NUM_THREADS, else the physical cores this process may use).",
    ),
]


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _digest_date(value: str | None, source: str) -> date:
    if value is None:
        today = datetime.now(UTC).date()
        return today - timedelta(days=1) if source == "arxiv" else today
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise _fail(f"--date must be YYYY-MM-DD, not {value!r}", EXIT_USAGE) from None


def _paper_id(value: str) -> str:
    from digest.paper import InvalidArxivId, parse_arxiv_id

    try:
        return parse_arxiv_id(value)[0]
    except InvalidArxivId as exc:
        raise _fail(f"--redo: {exc}", EXIT_USAGE) from None


def _out_dir(value: Path | None) -> Path:
    from engine.model_fetch import nightshift_home

    if value is not None:
        return value
    if env := os.environ.get("NIGHTSHIFT_DIGEST_DIR"):
        return Path(env)
    return nightshift_home() / "digests"


def _run_options(
    day: date,
    *,
    categories: str | None,
    max_papers: int | None,
    source: str,
    input_mode: str,
    endpoint: str,
    model: str | None,
    api_key_env: str | None,
    concurrency: int,
    db: str | None,
    out: Path | None,
    include_cross: bool,
    max_input_chars: int,
    site_url: str | None,
    local_speculation: bool = True,
    local_model: str = "default",
    republished: str = "mark",
    via: str = "stream",
    threads: int | None = None,
    overlap_days: float = DEFAULT_OVERLAP_DAYS,
    selection: str = "day",
    profile: Path | None = None,
    embeddings_endpoint: str | None = None,
    embeddings_model: str | None = None,
    email_to: str | None = None,
    webhook_url: str | None = None,
    price_per_mtok: str | None = None,
    gpu: str | None = None,
    gpus: int = 1,
    gpu_price: float | None = None,
) -> RunOptions:
    from digest.pipeline import RunOptions

    if via not in ("stream", "batch"):
        raise _fail(f"--via must be stream or batch, not {via!r}", EXIT_USAGE)
    if via == "batch" and "," in endpoint:
        raise _fail(
            "--via batch submits the night to one Batch API: give one --endpoint URL, not several",
            EXIT_USAGE,
        )
    if input_mode not in ("abstract", "fulltext"):
        raise _fail(f"--input must be abstract or fulltext, not {input_mode!r}", EXIT_USAGE)
    if concurrency < 1:
        raise _fail("--concurrency must be at least 1", EXIT_USAGE)
    if republished not in ("mark", "skip"):
        raise _fail(f"--republished must be mark or skip, not {republished!r}", EXIT_USAGE)
    if max_papers is not None and max_papers < 1:
        raise _fail("--max-papers must be at least 1", EXIT_USAGE)
    # Not NaN or infinite; a year is far more than any hold (and than the API pages through).
    if not 0 <= overlap_days <= 365:
        raise _fail(f"--overlap-days must be between 0 and 365, not {overlap_days}", EXIT_USAGE)
    cats = None if categories is None else [c.strip() for c in categories.split(",") if c.strip()]
    if cats is not None and not cats:
        raise _fail("--categories names no category", EXIT_USAGE)
    _check_categories(cats or [])
    _check_source(source)
    # Options another source reads: said, not silently ignored (found from outside).
    if include_cross and source != "rss":
        log.warning("--include-cross applies to --source rss only; ignored here")
    if overlap_days != DEFAULT_OVERLAP_DAYS and source != "arxiv":
        log.warning("--overlap-days applies to --source arxiv only; ignored here")
    _check_endpoint(endpoint, model, api_key_env, local_model)
    return RunOptions(
        digest_date=day,
        out_dir=_out_dir(out),
        categories=cats,
        max_papers=max_papers,
        source=source,
        input_mode=input_mode,
        endpoint=endpoint,
        model=model,  # type: ignore[arg-type]
        api_key_env=api_key_env,
        concurrency=concurrency,
        db_url=db,
        include_cross=include_cross,
        max_input_chars=max_input_chars,
        # A mirror or proxy of the arXiv endpoints (and the tests' unreachable host).
        arxiv_api_url=os.environ.get("NIGHTSHIFT_ARXIV_API_URL"),
        arxiv_rss_url=os.environ.get("NIGHTSHIFT_ARXIV_RSS_URL"),
        arxiv_html_url=os.environ.get("NIGHTSHIFT_ARXIV_HTML_URL"),
        site_url=site_url,
        local_model=local_model,
        republished=republished,  # type: ignore[arg-type]
        local_server_args=_local_server_args(endpoint, local_speculation, threads),
        via=via,  # type: ignore[arg-type]
        selection="new" if selection == "new" and source == "arxiv" else "day",
        overlap=timedelta(days=overlap_days),
        profile=_reader_profile(profile),
        profile_path=_profile_path(profile),
        embeddings=_embeddings(embeddings_endpoint, embeddings_model, api_key_env),
        delivery=_delivery(email_to, webhook_url, site_url),
        pricing=_pricing(price_per_mtok, gpu, gpus, gpu_price),
    )


def _pricing(
    price_per_mtok: str | None, gpu: str | None, gpus: int, gpu_price: float | None
) -> Pricing | None:
    """How the run report prices the night; a bad price or GPU name: one line, exit 2."""
    from digest.run_cost import Pricing

    if gpu is None and gpus != 1:  # the default is 1: a count given without a GPU to count
        raise _fail("--gpus needs --gpu", EXIT_USAGE)
    if price_per_mtok is None and gpu is None:
        if gpu_price is not None:
            raise _fail("--gpu-price needs --gpu", EXIT_USAGE)
        return None
    prices: tuple[float | None, float | None] = (None, None)
    if price_per_mtok is not None:
        try:
            price_in, price_out = (float(p) for p in price_per_mtok.split(","))
        except ValueError:
            raise _fail(
                f"--price-per-mtok must be IN,OUT (USD per million tokens), not {price_per_mtok!r}",
                EXIT_USAGE,
            ) from None
        prices = (price_in, price_out)
    try:
        return Pricing(*prices, gpu=gpu, gpus=gpus, price_per_gpu_hour=gpu_price)
    except ValueError as exc:  # also the catalogue's unknown GPU name
        raise _fail(str(exc), EXIT_USAGE) from None


def _reader_profile(path: Path | None) -> ReaderProfile | None:
    """The profile to rank by: --profile (it must exist), else the default file if present."""
    from digest.profile import ProfileError, default_profile_path, load_profile

    if path is None:
        path = default_profile_path()
        if not path.is_file():
            return None
    elif path.is_dir():
        raise _fail(f"--profile {path} is a directory, not a profile file", EXIT_USAGE)
    elif not path.is_file():
        raise _fail(
            f"--profile {path}: no such file (create one with `digest profile add`)", EXIT_USAGE
        )
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if profile.empty:
        log.warning("reader profile %s is empty: papers are not ranked", path)
        return None
    return profile


def _profile_path(path: Path | None) -> Path:
    """The file that each run reads again at its start (`digest schedule` runs for weeks)."""
    from digest.profile import default_profile_path

    return path if path is not None else default_profile_path()


def _embeddings(url: str | None, model: str | None, key_env: str | None) -> EmbeddingsConfig | None:
    from urllib.parse import urlsplit

    from digest.embeddings_client import EmbeddingsConfig

    if url is None:
        if model is not None:
            raise _fail("--embeddings-model needs --embeddings-endpoint", EXIT_USAGE)
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(f"--embeddings-endpoint must be an http(s) URL, not {url!r}", EXIT_USAGE)
    if not model:
        raise _fail("--embeddings-endpoint needs --embeddings-model", EXIT_USAGE)
    return EmbeddingsConfig(url, model, key_env)


def _delivery(
    email_to: str | None, webhook_url: str | None, site_url: str | None
) -> DeliveryConfig | None:
    """Checked at start: a bad address, URL or SMTP variable is one line and exit 2, not a
    failure after the night's model calls."""
    from digest.delivery import DeliveryConfigError, delivery_config

    recipients = [a for a in (email_to or "").split(",") if a.strip()]
    if email_to is not None and not recipients:
        raise _fail("--email-to names no address", EXIT_USAGE)
    try:
        return delivery_config(recipients, webhook_url or None, site_url)
    except DeliveryConfigError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


def _check_categories(categories: list[str]) -> None:
    """A malformed name is refused (it would go into the arXiv query as query syntax); an
    unknown one is named in a warning: it matches no paper."""
    from digest.sources import arxiv_categories

    if bad := arxiv_categories.malformed(categories):
        raise _fail(
            f"--categories: not an arXiv category name: {', '.join(map(repr, bad))} "
            "(names look like cs.CL, stat.ML, hep-th, cond-mat.str-el)",
            EXIT_USAGE,
        )
    for name in arxiv_categories.unknown(categories):
        log.warning("--categories: %s is not in arXiv's taxonomy; no paper will match it", name)


def _local_server_args(
    endpoint: str, local_speculation: bool, threads: int | None
) -> tuple[str, ...]:
    """The local server's own options (a bad --threads: one line, exit 2)."""
    from digest.endpoint import LOCAL
    from engine.cpu_threads import check_threads

    try:
        check_threads(threads)
    except ValueError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    spec = LOCAL_SPECULATION if local_speculation else ()
    if endpoint != LOCAL or threads is None:
        return spec
    return (*spec, "--threads", str(threads))


def _say_local_threads(endpoint: str, threads: int | None) -> None:
    """Log the local server's thread count at start (the server itself runs quiet): after the
    start checks, so that a setup mistake is the only line a failed start prints."""
    from digest.endpoint import LOCAL
    from engine.cpu_threads import choose_threads

    if endpoint != LOCAL:
        if threads is not None:
            log.warning("--threads sets the local server's threads; unused with --endpoint URL")
        return
    choice = choose_threads(threads)
    log.info("local server torch threads: %s", choice.describe())
    if choice.above_budget:
        log.warning(
            "local server threads: %d (%s) is more than the %d physical cores available: "
            "the threads will contend for them",
            choice.threads,
            choice.source,
            choice.budget.threads,
        )


def _check_source(source: str) -> None:
    """A source file is read at start: a bad one is a setup mistake (exit 2), for `digest run`
    and `digest schedule` alike, not a failed night that systemd retries."""
    from digest.sources.local_file import load_papers_file
    from workload.input_file import BadInputFile

    if source in ("arxiv", "rss"):
        return
    if not os.path.lexists(source):
        raise _fail(f"--source must be arxiv, rss or a file; no file {source!r}", EXIT_USAGE)
    try:
        load_papers_file(Path(source), None)
    except BadInputFile as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


def _check_endpoint(
    endpoint: str, model: str | None, api_key_env: str | None, local_model: str
) -> None:
    from digest.endpoint import EndpointError, check_endpoint
    from engine.errors import ModelLoadError

    try:
        check_endpoint(endpoint, model, api_key_env, local_model)
    except (EndpointError, ModelLoadError) as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


def _ready_out_dir(out: Path) -> Path:
    """Create the output folder at start, so that a file in its place or a folder we cannot
    write is one line before any work, not a traceback after the night's model calls."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _fail(
            f"--out {out}: cannot create the folder ({exc.strerror or exc})", EXIT_USAGE
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise _fail(f"--out {out}: cannot write in that folder", EXIT_USAGE)
    return out


def _start_checks(options: RunOptions, threads: int | None) -> None:
    """What `digest run` and `digest schedule` check before any work: the database, then the
    output folder (after the database, so that a wrong URL leaves nothing behind); then the
    local server's threads are said."""
    _database(options.db_url).dispose()
    _ready_out_dir(options.out_dir)
    _say_local_threads(options.endpoint, threads)


_RUN_FIELDS = (
    "categories",
    "max_papers",
    "source",
    "input_mode",
    "endpoint",
    "model",
    "api_key_env",
    "concurrency",
    "db",
    "out",
    "include_cross",
    "max_input_chars",
    "site_url",
    "local_speculation",
    "local_model",
    "republished",
    "via",
    "threads",
    "overlap_days",
    "profile",
    "embeddings_endpoint",
    "embeddings_model",
    "email_to",
    "webhook_url",
    "price_per_mtok",
    "gpu",
    "gpus",
    "gpu_price",
)


def _run_fields(values: dict) -> dict:
    """The run options among a command's parameters (`digest run` and `digest schedule` take
    the same ones; typer needs each command to declare them)."""
    return {name: values[name] for name in _RUN_FIELDS}


@digest_app.command("run")
def digest_run(
    date_: DateOpt = None,
    categories: CategoriesOpt = None,
    max_papers: MaxPapersOpt = None,
    source: SourceOpt = "arxiv",
    input_mode: InputOpt = "abstract",
    endpoint: EndpointOpt = "local",
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = 4,
    db: DbOpt = None,
    out: OutOpt = None,
    include_cross: CrossOpt = False,
    max_input_chars: MaxCharsOpt = 24_000,
    site_url: SiteUrlOpt = None,
    local_speculation: LocalSpecOpt = True,
    local_model: LocalModelOpt = "default",
    republished: RepublishedOpt = "mark",
    via: ViaOpt = "stream",
    threads: ThreadsOpt = None,
    overlap_days: OverlapOpt = DEFAULT_OVERLAP_DAYS,
    profile: ProfileOpt = None,
    embeddings_endpoint: EmbeddingsOpt = None,
    embeddings_model: EmbeddingsModelOpt = None,
    email_to: EmailToOpt = None,
    webhook_url: WebhookOpt = None,
    price_per_mtok: PriceOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = 1,
    gpu_price: GpuPriceOpt = None,
    redo: Annotated[
        list[str] | None,
        typer.Option(
            "--redo",
            metavar="PAPER_ID",
            help="Ask the model again for this paper of the date (repeatable), replacing its "
            "stored summary and review.",
        ),
    ] = None,
) -> None:
    """Fetch the day's papers, summarize and review each, store, and publish the digest."""
    from digest.sigterm import sigterm_unwinds

    # The command's run parameters are the run options (schedule shares them).
    # Nights select what is new since the last run; an explicit date is a backfill of that day.
    selection = "day" if date_ is not None else "new"
    options = _run_options(
        _digest_date(date_, source), selection=selection, **_run_fields(locals())
    )
    options.redo = tuple(_paper_id(value) for value in redo or ())
    _start_checks(options, threads)
    resume = f"stopped by SIGTERM; `digest run --date {options.digest_date}` resumes the run"
    with sigterm_unwinds(resume):
        report = _guarded(lambda: _run_with_progress(options))
    for line in report.lines():
        typer.echo(line)
    raise typer.Exit(report.exit_code)


def _run_with_progress(options: RunOptions) -> RunReport:
    from digest.pipeline import run_digest
    from digest.progress import paper_progress

    with paper_progress() as progress:
        return run_digest(options, progress)


def _guarded(action: Callable[[], T]) -> T:
    """Run `action`, turning the errors a user can act on into one line and an exit code."""
    from sqlalchemy.exc import DBAPIError

    from digest.batch_client import BatchAPIError
    from digest.endpoint import EndpointError
    from digest.pipeline import NoDigest, RedoError
    from digest.sources.polite_http import SourceError, SourceUnreachable
    from digest.store.database import StoreError, first_line
    from digest.store.job_lock import LockHeld
    from engine.errors import ModelLoadError
    from engine.server.server_process import ServerStartError
    from workload.input_file import BadInputFile

    try:
        return action()
    except SourceUnreachable as exc:
        raise _fail(
            f"{exc}\nNo network? Run from a local file instead: --source FILE (arXiv Atom, JSON "
            f"or JSONL with id, title, abstract, authors, categories), e.g. --source {SAMPLE}",
            EXIT_FAILED,
        ) from None
    except BadInputFile as exc:  # a source file (a SourceError too) that cannot be used
        raise _fail(str(exc), EXIT_USAGE) from None
    except (SourceError, LockHeld, ServerStartError, BatchAPIError) as exc:
        raise _fail(str(exc), EXIT_FAILED) from None
    except (EndpointError, StoreError, RedoError, ModelLoadError, NoDigest) as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    except DBAPIError as exc:  # the database went away mid-run: often transient, so exit 1
        raise _fail(f"database error: {first_line(exc.orig or exc)}", EXIT_FAILED) from None


@digest_app.command("render")
def digest_render(
    date_: StoredDateOpt = None,
    all_dates: Annotated[
        bool, typer.Option("--all", help="Every stored date (e.g. after losing --out).")
    ] = False,
    db: DbOpt = None,
    out: OutOpt = None,
    site_url: SiteUrlOpt = None,
) -> None:
    """Write a date's pages (and refresh feed and index) from the database; no model calls."""
    from digest.pipeline import NoDigest, render_all, render_date
    from digest.store import migrate
    from digest.store.digest_store import DigestStore

    if all_dates and date_:
        raise _fail("--all and --date exclude each other", EXIT_USAGE)
    engine = _database(db, create=False)  # it renders what a run stored: no new empty database
    _ready_out_dir(_out_dir(out))

    def render() -> list[Path]:
        migrate.upgrade(engine)
        store = DigestStore(engine)
        if all_dates:
            return render_all(store, _out_dir(out), site_url)
        day = _digest_date(date_, "render") if date_ else (store.digest_dates(1) or [None])[0]
        if day is None:
            raise NoDigest("the store holds no digest yet; run `nightshift digest run` first")
        return render_date(store, day, _out_dir(out), site_url)

    for path in _guarded(render):
        typer.echo(f"wrote {path}")


@digest_app.command("deliver")
def digest_deliver(
    date_: StoredDateOpt = None,
    email_to: EmailToOpt = None,
    webhook_url: WebhookOpt = None,
    again: Annotated[
        bool,
        typer.Option(help="Send also to targets that already received this version."),
    ] = False,
    db: DbOpt = None,
    site_url: LinkUrlOpt = None,
) -> None:
    """Send a stored digest (default: the newest) by email and/or webhook: a retry after a
    failed delivery. Targets that already received it as it is now are skipped."""
    from digest.delivery import deliver
    from digest.pipeline import NoDigest
    from digest.store import migrate
    from digest.store.digest_store import DigestStore
    from digest.store.job_lock import JobLock

    config = _delivery(email_to, webhook_url, site_url)
    if config is None:
        raise _fail("nothing to deliver to: give --email-to and/or --webhook-url", EXIT_USAGE)
    engine = _database(db, create=False)  # it sends what a run stored: no new empty database

    def send() -> list:
        migrate.upgrade(engine)
        store = DigestStore(engine)
        day = _digest_date(date_, "render") if date_ else (store.digest_dates(1) or [None])[0]
        digest = store.load_digest(day) if day else None
        if digest is None:
            what = f"no digest for {day.isoformat()}" if day else "no digest yet"
            raise NoDigest(f"the store holds {what}; run `nightshift digest run` first")
        # Under the job lock, as a run's delivery and a scheduler's retry: never two sends at once.
        with JobLock(engine):
            return deliver(store, digest, config, again=again)

    outcomes = _guarded(send)
    for outcome in outcomes:
        typer.echo(outcome.line())
    if any(outcome.status == "failed" for outcome in outcomes):
        raise typer.Exit(EXIT_FAILED)


@digest_app.command("schedule")
def digest_schedule(
    at: Annotated[
        str, typer.Option(help="Local time of the nightly run, HH:MM or HH:MM:SS.")
    ] = "02:00",
    timezone: Annotated[str, typer.Option(help="IANA timezone of --at.")] = "UTC",
    misfire_grace_time: Annotated[
        int, typer.Option(min=1, help="Seconds a missed run may still start late.")
    ] = 3600,
    delivery_retries: Annotated[
        int,
        typer.Option(
            min=0,
            max=100,
            help="Times a night's failed delivery is tried again (0: never); recorded in the "
            "deliveries table, so a restart continues the count.",
        ),
    ] = 4,
    delivery_retry_wait: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=86_400.0,
            help="Seconds from a failed delivery to its first retry; doubled after each.",
        ),
    ] = 600.0,
    categories: CategoriesOpt = None,
    max_papers: MaxPapersOpt = None,
    source: SourceOpt = "arxiv",
    input_mode: InputOpt = "abstract",
    endpoint: EndpointOpt = "local",
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = 4,
    db: DbOpt = None,
    out: OutOpt = None,
    include_cross: CrossOpt = False,
    max_input_chars: MaxCharsOpt = 24_000,
    site_url: SiteUrlOpt = None,
    local_speculation: LocalSpecOpt = True,
    local_model: LocalModelOpt = "default",
    republished: RepublishedOpt = "mark",
    via: ViaOpt = "stream",
    threads: ThreadsOpt = None,
    overlap_days: OverlapOpt = DEFAULT_OVERLAP_DAYS,
    profile: ProfileOpt = None,
    embeddings_endpoint: EmbeddingsOpt = None,
    embeddings_model: EmbeddingsModelOpt = None,
    email_to: EmailToOpt = None,
    webhook_url: WebhookOpt = None,
    price_per_mtok: PriceOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = 1,
    gpu_price: GpuPriceOpt = None,
) -> None:
    """Run the digest every night at --at (what arXiv announced since the last run); runs until
    stopped."""
    from digest.delivery.retry import RetryPolicy
    from digest.schedule import (
        ScheduleError,
        ScheduleOptions,
        build_scheduler,
        next_fire_time,
        run_scheduler,
    )

    options = _run_options(date.today(), selection="new", **_run_fields(locals()))
    # A wrong database URL or output folder fails the start (exit 2), not every night at 02:00.
    _start_checks(options, threads)
    try:
        retry = RetryPolicy(delivery_retries, delivery_retry_wait)
        schedule = ScheduleOptions(at, timezone, misfire_grace_time, retry)
        scheduler = build_scheduler(options, schedule)
    except ScheduleError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    job = scheduler.get_job("nightly-digest")
    nxt = next_fire_time(scheduler)
    log.info("digest scheduler: %s; next run %s", job.trigger, nxt.isoformat() if nxt else None)
    run_scheduler(scheduler)


def _database(db: str | None, *, create: bool = True) -> Engine:
    from digest.store.database import StoreError, open_database

    try:
        return open_database(db, create=create)
    except StoreError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None


def _migrating(action: Callable[[], T]) -> T:
    """A migration command's errors a user can act on as one line: an unknown revision (exit 2),
    a database that fails mid-way (exit 1)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from digest.store.database import first_line

    try:
        return action()
    except CommandError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    except DBAPIError as exc:
        raise _fail(f"database error: {first_line(exc.orig or exc)}", EXIT_FAILED) from None


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head", db: DbOpt = None
) -> None:
    """Migrate the database up to REVISION (default: the newest)."""
    from digest.store import migrate

    engine = _database(db)
    _migrating(lambda: migrate.upgrade(engine, revision))
    typer.echo(f"database at {migrate.current_revision(engine)}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision or base.")] = "-1",
    db: DbOpt = None,
) -> None:
    """Migrate the database down to REVISION (default: one step; 'base' empties it)."""
    from digest.store import migrate

    engine = _database(db)
    _migrating(lambda: migrate.downgrade(engine, revision))
    typer.echo(f"database at {migrate.current_revision(engine) or 'base'}")


@db_app.command("current")
def db_current(db: DbOpt = None) -> None:
    """Print the database's migration revision and the newest one available."""
    from digest.store import migrate

    engine = _database(db, create=False)  # a look must not leave a new empty database behind
    current = _migrating(lambda: migrate.current_revision(engine)) or "base (empty)"
    typer.echo(f"current: {current}\nhead:    {migrate.head_revision()}")


# `digest profile add|remove|show` (nightshift/profile_commands.py); imported last because it
# uses this module's helpers.
from nightshift.profile_commands import profile_app  # noqa: E402

digest_app.add_typer(profile_app, name="profile")

# `digest search` and `digest serve` (nightshift/search_commands.py), added the same way.
from nightshift.search_commands import register as _register_search  # noqa: E402

_register_search(digest_app)
