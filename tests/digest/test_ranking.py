"""Ranking by a reader profile: followed authors and keywords, a TF-IDF + linear SVM per tag
(as arxiv-sanity-lite), and embeddings from an OpenAI-compatible /v1/embeddings endpoint on
loopback (one request per batch; an endpoint that fails leaves the ranking to TF-IDF)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from digest.embeddings_client import EmbeddingError, EmbeddingsConfig, embed_texts
from digest.paper import Paper
from digest.profile import ReaderProfile, TaggedPaper
from digest.ranking import rank_papers

SPEECH = [
    "Streaming speech recognition with transducers and acoustic encoders",
    "Self-supervised speech representations for low-resource acoustic modelling",
    "Text-to-speech synthesis with neural vocoders and prosody control",
    "Speaker diarization of meeting audio with acoustic embeddings",
]
OTHER = [
    "Graph neural networks for molecule property prediction",
    "Reinforcement learning for robotic grasping in clutter",
    "Sparse attention for long document summarization",
    "Retrieval-augmented question answering over tables",
    "Tokenizer-free language models on bytes",
    "Scaling laws for mixture-of-experts training",
    "Benchmarking code generation with unit tests",
    "Federated learning with differential privacy guarantees",
]


def _paper(n: int, title: str, authors: list[str] | None = None) -> Paper:
    abstract = f"We present work on {title.lower()}. Experiments show gains."
    return Paper(f"2603.{n:05d}", title, abstract, authors or ["Ada Lovelace"])


def _tonight() -> list[Paper]:
    # Interleaved, so that the source order alone would not put speech first.
    titles = [t for pair in zip(OTHER, SPEECH + SPEECH) for t in pair][:12]
    return [_paper(n, t) for n, t in enumerate(titles, 1)]


def _liked_speech() -> list[TaggedPaper]:
    return [
        TaggedPaper("End-to-end speech recognition", "Acoustic models and speech encoders."),
        TaggedPaper("Neural speech synthesis", "Vocoders for speech and prosody."),
        TaggedPaper("Audio representation learning", "Self-supervised acoustic features."),
    ]


def test_a_tag_ranks_its_topic_first_and_says_why():
    papers = _tonight()
    background = [f"{t}. Another paper about {t.lower()}." for t in OTHER * 3]
    ranked = rank_papers(papers, ReaderProfile(tags={"speech": _liked_speech()}), background)
    top = [r.paper.title for r in ranked[:6]]
    assert all(t in SPEECH for t in top), top
    assert all(r.paper.title not in SPEECH for r in ranked[6:])
    picked = [r for r in ranked if r.for_you]
    assert picked and all(r.paper.title in SPEECH for r in picked)
    assert picked[0].reasons == ["like your “speech” papers"]


def test_authors_and_keywords_outrank_the_classifier_and_match_whole_words():
    papers = [
        _paper(1, "Fragmented memory in agents"),  # "rag" inside a word: no match
        _paper(2, "RAG for tables"),
        _paper(3, "Speaker diarization", ["Tri  Dao", "Ada Lovelace"]),
        _paper(4, "Streaming speech recognition with transducers"),
    ]
    profile = ReaderProfile(keywords=["RAG"], authors=["tri dao"], tags={"s": _liked_speech()})
    ranked = rank_papers(papers, profile)
    assert [r.paper.arxiv_id for r in ranked[:2]] == ["2603.00003", "2603.00002"]
    assert ranked[0].reasons[0] == "by tri dao"
    assert ranked[1].reasons == ["mentions “RAG”"]
    assert next(r for r in ranked if r.paper.arxiv_id == "2603.00001").reasons == []


def test_authors_and_keywords_match_whatever_their_accents():
    """Found from outside: `--author "Gaetan Peter"` never matched arXiv's "Gaëtan Peter", nor
    `--keyword "naive Bayes"` an abstract's "naïve Bayes" (TF-IDF strips accents; these did
    not)."""
    papers = [
        _paper(1, "Graph neural networks"),
        _paper(2, "Security benchmarks", ["Gaëtan Peter", "Roos Wensveen"]),
        Paper("2603.00003", "Text classifiers", "A naïve  Bayes baseline.", ["A. B."]),
    ]
    profile = ReaderProfile(keywords=["Naive Bayes"], authors=["Gaetan Peter"])
    ranked = rank_papers(papers, profile)
    assert [(r.paper.arxiv_id, r.reasons) for r in ranked[:2]] == [
        ("2603.00002", ["by Gaetan Peter"]),
        ("2603.00003", ["mentions “Naive Bayes”"]),
    ]
    # And the other way round: a profile typed with accents matches a plain spelling.
    plain = ReaderProfile(authors=["Gaëtan Péter"])
    assert rank_papers([_paper(4, "X", ["Gaetan Peter"])], plain)[0].for_you


def test_ties_keep_the_source_order_and_an_empty_night_is_empty():
    papers = [_paper(n, t) for n, t in enumerate(OTHER, 1)]
    ranked = rank_papers(papers, ReaderProfile(keywords=["nothing matches this"]))
    assert [r.paper for r in ranked] == papers
    assert rank_papers([], ReaderProfile(keywords=["x"])) == []


class _Embeddings(ThreadingHTTPServer):
    """A fake /v1/embeddings: a text about speech points one way, anything else the other."""

    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _EmbeddingsHandler)
        self.status = status
        self.bodies: list[dict] = []
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self) -> _Embeddings:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _EmbeddingsHandler(BaseHTTPRequestHandler):
    server: _Embeddings

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if self.server.status != 200:
            data = b'{"error": {"message": "model not loaded"}}'
        else:
            vectors = [
                [1.0, 0.1] if "speech" in text.lower() or "acoustic" in text.lower() else [0.0, 1.0]
                for text in body["input"]
            ]
            # Out of order on purpose: the client must sort by index.
            items = [{"index": i, "embedding": v} for i, v in enumerate(vectors)][::-1]
            data = json.dumps({"object": "list", "data": items}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_embeddings_add_similarity_in_bounded_batches():
    papers = _tonight()
    profile = ReaderProfile(tags={"speech": _liked_speech()})
    with _Embeddings() as server:
        config = EmbeddingsConfig(server.url, "embedder", batch_size=5)
        ranked = rank_papers(papers, profile, embed=lambda texts: embed_texts(config, texts))
    # 12 papers and 3 tagged ones in batches of 5: three requests, each naming the model.
    assert [len(b["input"]) for b in server.bodies] == [5, 5, 5]
    assert {b["model"] for b in server.bodies} == {"embedder"}
    speech = [r for r in ranked if r.paper.title in SPEECH]
    assert all("close to your papers (embedding similarity 1.00)" in r.reasons for r in speech)
    assert all(r.paper.title in SPEECH for r in ranked[: len(speech)])


def test_a_failing_embeddings_endpoint_leaves_the_ranking_to_tf_idf(caplog):
    papers = _tonight()
    profile = ReaderProfile(tags={"speech": _liked_speech()})
    with _Embeddings(status=503) as server:
        config = EmbeddingsConfig(server.url, "embedder")
        with pytest.raises(EmbeddingError, match="HTTP 503: .*model not loaded"):
            embed_texts(config, ["x"])
        ranked = rank_papers(papers, profile, embed=lambda texts: embed_texts(config, texts))
    without = rank_papers(papers, profile)
    assert [r.paper.arxiv_id for r in ranked] == [r.paper.arxiv_id for r in without]
    assert np.allclose([r.score for r in ranked], [r.score for r in without])
    assert "embeddings unavailable" in caplog.text and "HTTP 503" in caplog.text
    with pytest.raises(EmbeddingError, match="cannot|ConnectError"):
        embed_texts(EmbeddingsConfig("http://127.0.0.1:9/v1", "m", timeout_s=2), ["x"])


def test_a_run_ranks_with_embeddings_from_the_endpoint(tmp_path, sqlite_url):
    from digest.pipeline import run_digest
    from digest.store.database import open_database
    from digest.store.digest_store import DigestStore
    from tests.digest.fault_server import FaultServer
    from tests.digest.test_pipeline import DAY, options, write_papers

    titles = ["Graph networks for molecules", "Streaming speech recognition", "Sparse attention"]
    source = write_papers(tmp_path / "three.jsonl", titles)
    profile = ReaderProfile(tags={"speech": _liked_speech()})
    with _Embeddings() as server, FaultServer() as stub:
        config = EmbeddingsConfig(server.url, "embedder")
        run = options(tmp_path, sqlite_url, stub.base_url, source=str(source), profile=profile)
        run.embeddings, run.max_papers = config, 1
        report = run_digest(run)
    assert (report.papers_done, report.papers_below_cut) == (1, 2)
    assert len(server.bodies) == 1  # 3 papers and 3 tagged ones: one batch
    digest = DigestStore(open_database(sqlite_url)).load_digest(DAY)
    assert digest is not None
    (mine,) = digest.for_you
    assert mine.paper.title == "Streaming speech recognition"
    assert "close to your papers (embedding similarity 1.00)" in mine.for_you


def test_the_embeddings_options_are_checked_at_start(tmp_path, sqlite_url):
    from typer.testing import CliRunner

    from nightshift.cli import app

    base = ["digest", "run", "--source", "examples/papers-2026-03-sample.jsonl", "--db"]
    base += [sqlite_url, "--out", str(tmp_path / "out"), "--endpoint", "http://127.0.0.1:9/v1"]
    base += ["--model", "m"]
    for extra, problem in [
        (["--embeddings-model", "e"], "--embeddings-model needs --embeddings-endpoint"),
        (["--embeddings-endpoint", "127.0.0.1:8000"], "must be an http(s) URL"),
        (["--embeddings-endpoint", "http://127.0.0.1:8000/v1"], "needs --embeddings-model"),
    ]:
        result = CliRunner().invoke(app, [*base, *extra])
        assert result.exit_code == 2 and problem in result.output, result.output
