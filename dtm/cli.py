"""The `dtm` command.

    dtm ir check FILE        parse and verify; errors as FILE:LINE:COL: CODE: message
    dtm ir fmt FILE          print the canonical text (--target 1.0 writes an older version)
    dtm ir hash FILE         print the module hash (hex sha256 of the canonical encoding)
    dtm ir ops               print the op registry
    dtm conformance ir       run the IR conformance vectors
    dtm conformance protocol run the wire protocol conformance vectors
    dtm conformance checkpoint   run the checkpoint conformance vectors
    dtm conformance exec     run the execution vectors (every op's example, on ref, cpu and L0)
    dtm conformance all      every suite, and the claim matrix by level and capability
    dtm launch -n N script.py   run N local ranks (DTM_* environment, output prefixed by rank)
    dtm coordinator --world-size N   run a coordinator on its own
    dtm store ls|info|get|put|rm|du|gc|recover|verify|export|import   the tensor store (--store PATH/URL)
    dtm tasks run FILE --store DIR   run the task declarations of an IR module
    dtm ingest FILES... --fn MOD:FUNC --prefix P   files -> token shards in the store, in parallel
    dtm top [--coordinator HOST:PORT]   live view of a running job's ranks (its metrics endpoint)

FILE may be `-` for standard input. Every failure exits non-zero with the error on stderr.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile
from typing import Iterator

import click

from . import ir
from .ir.version import PACKAGE_VERSION, SPEC_VERSION


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read(ir.parser.MAX_TEXT_CHARS + 1)
    except OSError as e:
        raise click.ClickException(f"{path}: cannot read: {e.strerror}") from None


def _load(path: str, check: bool = True) -> ir.Module:
    """Parse (and verify) FILE; on IRError print it compiler-style and exit 1."""
    data = _read(path)
    try:
        module = ir.parse(data)
        return ir.verify(module) if check else module
    except ir.IRError as e:
        text = data.decode("utf-8", errors="replace")
        click.echo(ir.render(e, text, "<stdin>" if path == "-" else path), err=True)
        sys.exit(1)


def _version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise click.BadParameter(f"expected MAJOR.MINOR, e.g. 1.0, found {text!r}") from None


@click.group()
@click.version_option(PACKAGE_VERSION, message=f"dtm %(version)s (spec {'.'.join(map(str, SPEC_VERSION))})")
def main() -> None:
    """DTM, the Distributed Tensor Machine."""


@main.group("ir")
def ir_group() -> None:
    """Read, check, format and hash DTM IR (.dtm files)."""


@ir_group.command("check")
@click.argument("file")
def ir_check(file: str) -> None:
    """Parse and verify FILE."""
    m = _load(file)
    n_ops = sum(len(f.ops) for f in m.funcs.values())
    click.echo(f"{file}: ok: {len(m.funcs)} function(s), {n_ops} op(s), {len(m.meshes)} mesh(es), "
               f"{len(m.tasks)} task(s); hash {m.hash()}")


@ir_group.command("fmt")
@click.argument("file")
@click.option("--target", default=None, help="write for this older 1.x spec version, e.g. 1.0")
@click.option("--in-place", "-i", is_flag=True, help="rewrite FILE instead of printing")
def ir_fmt(file: str, target: str | None, in_place: bool) -> None:
    """Print FILE in canonical form."""
    m = _load(file)
    try:
        text = ir.format(m, target=_version(target))
    except ir.IRError as e:
        click.echo(ir.render(e, _read(file).decode("utf-8", "replace"), file), err=True)
        sys.exit(1)
    if in_place and file != "-":
        # Atomic: a crash leaves either the old file or the new one, never half of it.
        d = os.path.dirname(os.path.abspath(file))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".dtm-fmt-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    else:
        click.echo(text, nl=False)


@ir_group.command("hash")
@click.argument("file")
def ir_hash(file: str) -> None:
    """Print the module hash of FILE."""
    click.echo(_load(file).hash())


@ir_group.command("ops")
def ir_ops() -> None:
    """Print the op registry."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DTM IR ops (spec {'.'.join(map(str, SPEC_VERSION))})")
    for col in ("op", "category", "since", "operands", "attributes", "summary"):
        table.add_column(col)
    for d in ir.REGISTRY.values():
        attrs = ", ".join(f"{a.name}: {a.kind.value}" for a in d.attrs)
        table.add_row(d.name, d.category.value, f"{d.since[0]}.{d.since[1]}", ", ".join(d.operands), attrs, d.summary)
    Console().print(table)


@main.group("conformance")
def conformance_group() -> None:
    """Run the language-agnostic conformance vectors."""


def _report_vectors(results) -> None:
    """Failures on stderr, "N passed, M failed" on stdout; exit 1 on a failure or no vectors."""
    failed = [r for r in results if not r.ok]
    for r in failed:
        click.echo(f"FAIL {r.kind} {r.name}: {r.detail}", err=True)
    click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed or not results else 0)


@conformance_group.command("ir")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/ir)")
def conformance_ir(root: str | None) -> None:
    """Run the IR vectors: valid modules against their canonical text and hash, invalid ones
    against their error code and line:col."""
    from .ir.conformance import run_ir_vectors

    results = run_ir_vectors(pathlib.Path(root) if root else None)
    _report_vectors(results)


@conformance_group.command("protocol")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/protocol)")
def conformance_protocol(root: str | None) -> None:
    """Run the wire protocol vectors: valid byte streams against their decoded frames and
    back, invalid ones against their error code, and the handshake's HMAC answers."""
    from .protocol.conformance import run_protocol_vectors

    results = run_protocol_vectors(pathlib.Path(root) if root else None)
    _report_vectors(results)


@conformance_group.command("checkpoint")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/checkpoint)")
def conformance_checkpoint(root: str | None) -> None:
    """Run the checkpoint vectors: a checkpoint saved on a 2 x 2 mesh loaded onto 1 and 3
    ranks against the CRC32C of every piece, damaged copies against their error code."""
    from .ckpt.conformance import run_checkpoint_vectors

    results = run_checkpoint_vectors(pathlib.Path(root) if root else None)
    _report_vectors(results)


@conformance_group.command("tasks")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/tasks)")
def conformance_tasks(root: str | None) -> None:
    """Run the task-graph vectors (spec 9.3.8): graphs of IR tasks over a store against the
    store and task states they must leave, and graphs refused before anything runs against
    their error code."""
    from .tasks.conformance import run_task_vectors

    _report_vectors(run_task_vectors(pathlib.Path(root) if root else None))


@conformance_group.command("quotas")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/quotas)")
def conformance_quotas(root: str | None) -> None:
    """Run the quota vectors (spec 9.4.14): sizes as written against their bytes, and store
    operations under per-prefix quotas against the outcome of each."""
    from .store.conformance import run_quota_vectors

    _report_vectors(run_quota_vectors(pathlib.Path(root) if root else None))


@conformance_group.command("exec")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/exec)")
@click.option("--executor", "executors", multiple=True, type=click.Choice(["ref", "cpu", "l0", "l1"]),
              help="run on these executors only (default: ref, cpu and l0; l1 starts a process per rank)")
def conformance_exec(root: str | None, executors: tuple[str, ...]) -> None:
    """Run the execution vectors (spec 8.4): every op's example program on the reference
    interpreter, the cpu backend and L0's devices (and, with --executor l1, the vectors with a
    mesh over processes, a rank each), against the outputs the spec gives."""
    from .runtime.exec_l1 import run_l1_vectors
    from .runtime.exec_vectors import EXECUTORS, run_exec_vectors

    where = pathlib.Path(root) if root else None
    here = [e for e in executors or EXECUTORS if e != "l1"]
    results = run_exec_vectors(where, here) if here else []
    if "l1" in executors:
        results += [r for r in run_l1_vectors(where) if r.kind == "l1" or not here]  # ("valid" ones said once)
    _report_vectors(results)


# The claim matrix (spec 8.5): each capability's vectors, by suite and vector name. A
# protocol vector no other capability names is the frames' and handshake's (membership).
_PROTOCOL_CAPS = {
    "CAP_WIRE_COLLECTIVES": ("collective_", "data", "empty_stream", "streams_interleaved", "large_u64", "error",
                             "seq_", "first_seq"),
    "CAP_P2P": ("p2p_",),
    "CAP_STORE": ("store_",),
    "CAP_QUANT": ("data_compressed_", "quantized_dtypes", "hello_l1_with_quant", "hello_l2_without_quant",
                  "compressed_flag_on_leave"),
    "CAP_CANCEL": ("cancel",),
    "CAP_CHECKSUMS": ("p2p_send_crc", "collective_start_broadcast"),
    "CAP_RESIZE": ("resize_", "succession_rejoin"),
}


def _claims(exec_manifest: dict) -> list[tuple[str, int, list[tuple[str, object]]]]:
    """(capability, level, [(suite, does a result of that suite count)]) in the order of 8.2."""
    def protocol(cap: str):
        if cap != "CAP_MEMBERSHIP":
            return lambda r: r.name.startswith(_PROTOCOL_CAPS[cap])
        return lambda r: not any(r.name.startswith(p) for ps in _PROTOCOL_CAPS.values() for p in ps)

    info = exec_manifest.get("vectors", {})

    def vector(r) -> dict:
        return info.get(r.name, {})

    def store(r) -> bool:
        return any(op.startswith("store_") for op in vector(r).get("ops", ()))

    return [
        ("CAP_IR", 0, [("ir", lambda r: True)]),
        ("CAP_EXEC", 0, [("exec", lambda r: r.kind in ("ref", "cpu", "valid") and vector(r).get("ranks", 1) == 1
                                  and not store(r))]),
        ("CAP_LOCAL_COLLECTIVES", 0, [("exec", lambda r: vector(r).get("ranks", 1) > 1)]),
        ("CAP_MEMBERSHIP", 1, [("protocol", protocol("CAP_MEMBERSHIP"))]),
        ("CAP_WIRE_COLLECTIVES", 1, [("protocol", protocol("CAP_WIRE_COLLECTIVES"))]),
        ("CAP_P2P", 1, [("protocol", protocol("CAP_P2P"))]),
        ("CAP_STORE", 2, [("protocol", protocol("CAP_STORE")), ("exec", store)]),
        ("CAP_TASKS", 2, [("tasks", lambda r: True)]),
        ("CAP_QUANT", 2, [("protocol", protocol("CAP_QUANT")), ("exec", lambda r: vector(r).get("quantized", False))]),
        ("CAP_CKPT", 3, [("checkpoint", lambda r: True)]),
        ("CAP_CANCEL", 3, [("protocol", protocol("CAP_CANCEL"))]),
        ("CAP_CHECKSUMS", 3, [("protocol", protocol("CAP_CHECKSUMS")),
                              ("checkpoint", lambda r: r.name.startswith("flipped_byte"))]),
        ("CAP_QUOTAS", 3, [("quotas", lambda r: True)]),
        ("CAP_RESIZE", 3, [("protocol", protocol("CAP_RESIZE"))]),
    ]


def claim_matrix() -> dict:
    """Run every suite and build spec 8.5's matrix: {"implementation", "spec_version",
    "claims": [{"capability", "level", "status", "vectors", "failed", "first_failure"}]}."""
    import json

    from .ckpt.conformance import run_checkpoint_vectors
    from .ir.conformance import run_ir_vectors
    from .protocol.conformance import run_protocol_vectors
    from .runtime.exec_vectors import default_root, run_exec_vectors
    from .store.conformance import run_quota_vectors
    from .tasks.conformance import run_task_vectors

    suites = {"ir": run_ir_vectors(), "protocol": run_protocol_vectors(), "exec": run_exec_vectors(),
              "checkpoint": run_checkpoint_vectors(), "tasks": run_task_vectors(), "quotas": run_quota_vectors()}
    try:
        exec_manifest = json.loads((default_root() / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        exec_manifest = {}
    claims = []
    for cap, level, picks in _claims(exec_manifest):
        mine = [(suite, r) for suite, keep in picks for r in suites[suite] if keep(r) or r.name == "manifest.json"]
        failed = [(suite, r) for suite, r in mine if not r.ok]
        first = f"{failed[0][0]}: {failed[0][1].name} ({failed[0][1].kind}): {failed[0][1].detail}" if failed else None
        status = "untested" if not mine else "fail" if failed else "pass"
        claims.append({"capability": cap, "level": f"L{level}", "status": status, "vectors": len(mine),
                       "failed": len(failed), "first_failure": first})
    return {"implementation": f"dtm {PACKAGE_VERSION}", "spec_version": ".".join(map(str, SPEC_VERSION)),
            "claims": claims}


@conformance_group.command("all")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="also write the matrix as JSON to this file (spec 8.5)")
def conformance_all(json_path: str | None) -> None:
    """Run every suite DTM claims (IR, protocol, execution, task-graph, quota and checkpoint
    vectors) and print the claim matrix (spec 8.5), level by level and capability by
    capability; exit 1 when a claimed capability fails."""
    import json

    from rich.console import Console
    from rich.table import Table

    matrix = claim_matrix()
    table = Table(title=f"{matrix['implementation']}: claims of spec {matrix['spec_version']}")
    for col in ("level", "capability", "status", "vectors", "first failure"):
        table.add_column(col)
    colour = {"pass": "green", "fail": "red", "untested": "yellow"}
    for c in matrix["claims"]:
        table.add_row(c["level"], c["capability"], f"[{colour[c['status']]}]{c['status']}[/]", str(c["vectors"]),
                      c["first_failure"] or "")
    Console().print(table)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(matrix, indent=1) + "\n", encoding="utf-8")
    sys.exit(1 if any(c["status"] == "fail" for c in matrix["claims"]) else 0)


def _axes_option(text: str | None):
    from .cluster.env import parse_axes
    from .errors import DTMError

    try:
        return parse_axes(text or "", "--axes")
    except DTMError as e:
        raise click.BadParameter(e.message) from None


def _names(text: str | None) -> tuple[str, ...]:
    """A comma-separated list of names (--give-way) as a tuple."""
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


def _elastic_option(text: str | None) -> tuple[int, int] | None:
    """--elastic MIN:MAX as (MIN, MAX)."""
    if text is None:
        return None
    least, sep, most = text.partition(":")
    if not sep or not least.strip().isdigit() or not most.strip().isdigit():
        raise click.BadParameter(f"{text!r}: expected MIN:MAX, e.g. 2:8", param_hint="--elastic")
    return int(least), int(most)


@main.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nprocs", type=click.IntRange(min=1), required=True, help="number of ranks to start")
@click.option("--coordinator", metavar="HOST:PORT", default=None,
              help="a running coordinator (`dtm coordinator`; DTM_TOKEN must be its token); by default dtm launch "
                   "runs one itself")
@click.option("--axes", default=None, metavar="NAME=SIZE,...", help="mesh axes, e.g. dp=2,tp=2")
@click.option("--grace", type=float, default=5.0, show_default=True,
              help="seconds between SIGTERM and SIGKILL when ranks are ended")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="seconds for every rank to call dtm.init() (with the launcher's own coordinator)")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="DTM_METRICS_PORT",
              help="serve the coordinator's Prometheus metrics at this port (default: a free one; `dtm top` "
                   "finds it)")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="DTM_METRICS_HOST",
              help="address the metrics are served at")
@click.option("--on-failure", type=click.Choice(["stop", "continue"]), default=None,
              help="when a rank fails: stop (end the other ranks) or continue (let them finish; the mesh's store "
                   "reads the failed rank's keys from their replicas); default: continue when the job called "
                   "dtm.init(elastic=True), else stop")
@click.option("--memory-quota", default=None, metavar="SIZE",
              help="each rank's memory quota (2G, 512M): an allocation that would pass it is refused with E0811 "
                   "(DTM_MEMORY_QUOTA in the ranks' environment)")
@click.option("--store-quota", default=None, metavar="SIZE",
              help="the bytes each rank's part of the mesh's store may hold (1G, 512M): a put that would pass it is "
                   "refused with E1103 (DTM_STORE_QUOTA in the ranks' environment)")
@click.option("--elastic", default=None, metavar="MIN:MAX",
              help="resize the mesh live (spec 9.6.7): a lost rank shrinks it, ranks started with --join grow it, "
                   "between MIN and MAX ranks; the job goes on (dtm.elastic.steps)")
@click.option("--give-way", default=None, metavar="AXIS,...",
              help="with --elastic: the mesh axes that shrink first (default: dp, then the others from the last)")
@click.option("--join", default=None, metavar="HOST:PORT",
              help="start the ranks into the running elastic job whose coordinator is at HOST:PORT (its token: "
                   "DTM_TOKEN, or the job's file on this machine)")
@click.option("--ray", "ray_address", default=None, is_flag=False, flag_value="", metavar="[ADDRESS]",
              help="run each rank on a Ray actor of the Ray cluster at ADDRESS (HOST:PORT, ray://HOST:PORT, auto; "
                   "none: RAY_ADDRESS, else a local Ray), one placement-group bundle per rank; with --elastic a rank "
                   "whose actor died is replaced by a new one that joins")
@click.option("--spread", is_flag=True, help="with --ray: every rank on a distinct node (STRICT_SPREAD)")
@click.option("--ray-cpus", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help="with --ray: the CPUs of each rank's bundle (and its kernel threads)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(nprocs: int, coordinator: str | None, axes: str | None, grace: float, join_timeout: float,
               metrics_port: int | None, metrics_host: str, on_failure: str | None, memory_quota: str | None,
               store_quota: str | None, elastic: str | None, give_way: str | None, join: str | None,
               ray_address: str | None, spread: bool, ray_cpus: float, command: tuple[str, ...]) -> None:
    """Run COMMAND (script.py [args...], -m module [args...], or a program) as NPROCS local
    ranks; their output is forwarded with a `[rank k]` prefix. When one rank fails, the
    others are ended (--on-failure stop) or finish (continue), and dtm launch exits non-zero
    naming the rank that failed. Once every rank has ended, the run's mesh store (its parts
    in $DTM_MESH_STORE or /dev/shm, wherever each rank kept them) is removed."""
    import logging

    from .cluster.launch import launch
    from .errors import DTMError

    logging.basicConfig(level=logging.WARNING, format="dtm launch: %(message)s")
    from .runtime.host import parse_bytes

    for option, size, env in (("--memory-quota", memory_quota, "DTM_MEMORY_QUOTA"),
                              ("--store-quota", store_quota, "DTM_STORE_QUOTA")):
        if size is not None:
            try:
                os.environ[env] = str(parse_bytes(size, option))  # the ranks inherit it
            except DTMError as e:
                raise click.BadParameter(e.message) from None
    if ray_address and ":" not in ray_address and ray_address not in ("auto", "local"):
        raise click.BadParameter(f"{ray_address!r} is not a Ray address (HOST:PORT, ray://HOST:PORT, auto, local); "
                                 "--ray without an address goes before another option, e.g. --ray -n 4 job.py",
                                 param_hint="--ray")
    if not command:
        raise click.UsageError("dtm launch needs a script (or -m module, or a command) to run")
    if ray_address is None and (spread or ray_cpus != 1.0):
        raise click.BadParameter("only with --ray", param_hint="--spread/--ray-cpus")
    try:
        status = launch(command, nprocs, coordinator=coordinator, axes=_axes_option(axes), grace=grace,
                        join_timeout=join_timeout, metrics=(metrics_host, metrics_port or 0),
                        on_failure=on_failure, elastic=_elastic_option(elastic),
                        give_way=_names(give_way), join=join, ray=ray_address, spread=spread, ray_cpus=ray_cpus)
    except DTMError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(status)


@main.command("coordinator")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen at")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="port to listen at (0: any free port)")
@click.option("--world-size", type=click.IntRange(min=1), required=True, help="number of ranks in the mesh")
@click.option("--axes", default=None, metavar="NAME=SIZE,...", help="mesh axes, e.g. dp=2,tp=2")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="seconds for every rank to join")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, envvar="DTM_METRICS_PORT",
              help="serve Prometheus metrics at this port (default: a free one; `dtm top` finds it)")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="DTM_METRICS_HOST",
              help="address the metrics are served at")
@click.option("--elastic", default=None, metavar="MIN:MAX",
              help="resize the mesh live between MIN and MAX ranks (spec 9.6.7)")
@click.option("--give-way", default=None, metavar="AXIS,...", help="with --elastic: the axes that shrink first")
def coordinator_cmd(host: str, port: int, world_size: int, axes: str | None, join_timeout: float, metrics_port: int,
                    metrics_host: str, elastic: str | None, give_way: str | None) -> None:
    """Run a coordinator for WORLD_SIZE ranks until the mesh has formed and every rank has
    left (exit 0) or one was lost or the mesh did not form (exit 1). Ranks reach it with
    DTM_COORDINATOR=HOST:PORT and DTM_COORDINATOR_EXTERNAL=1; the cluster token is DTM_TOKEN,
    and DTM_HEARTBEAT_MS and DTM_HEARTBEAT_TIMEOUT_MS set the failure detection."""
    import logging

    from .cluster.coordinator import Coordinator
    from .cluster.env import heartbeat_env
    from .cluster.resize import ElasticCoordinator
    from .errors import DTMError

    logging.basicConfig(level=logging.INFO, format="dtm %(message)s")
    token = os.environ.get("DTM_TOKEN", "")
    if not token:
        click.echo("dtm coordinator: DTM_TOKEN is empty: any process that reaches the port may join", err=True)
    try:
        heartbeat_ms, timeout_ms = heartbeat_env()
        kind, extra = (Coordinator, {}) if elastic is None else (ElasticCoordinator, {
            "elastic": _elastic_option(elastic), "give_way": _names(give_way)})
        coord = kind(world_size, token, host=host, port=port, axes=_axes_option(axes), heartbeat_ms=heartbeat_ms,
                     timeout_ms=timeout_ms, join_timeout=join_timeout, metrics=(metrics_host, metrics_port), **extra)
    except DTMError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"dtm coordinator listening at {coord.address[0]}:{coord.address[1]} for {world_size} rank(s); "
               f"metrics at {coord.metrics.url}")
    sys.stdout.flush()
    coord.serve()
    sys.exit(1 if coord.error or coord.lost else 0)


# --- the tensor store --------------------------------------------------------------------

@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """A DTMError, or an OS error on a file the command reads or writes (E1104), becomes one
    line on stderr and exit status 1, never a traceback."""
    from .errors import DTMError, ErrorCode as E

    try:
        yield
    except DTMError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(str(DTMError(E.STORE_IO_ERROR, f"{e.filename}: {e.strerror or e}"))) from None


def _store():
    """The store `--store` names (default: as dtm.store.open()). A `memory://` store is
    refused: it would die with this command, so a put would report success and lose its data."""
    from . import store
    from .errors import DTMError, ErrorCode as E

    url = click.get_current_context().obj
    if url is not None and str(url).startswith("memory://"):
        raise DTMError(E.ATTRIBUTE_VALUE, f"{url}: a memory:// store lives only as long as its process, and each "
                       "`dtm store` command is a process of its own; name a directory")
    return store.open(url)


def _table(title: str, columns: tuple[str, ...], rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col in ("bytes", "keys", "version", "chunks") else "left")
    for row in rows:
        table.add_row(*map(str, row))
    Console(width=200).print(table)


def _type(info) -> str:
    return f"{info.dtype}{list(info.shape)}"


def _when(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


@main.group("store")
@click.option("--store", "url", default=None, metavar="PATH|URL",
              help="a store directory, or a file:// or memory:// URL, as dtm.store.open takes; default DTM_STORE, "
                   "else ~/.cache/dtm/store")
@click.pass_context
def store_group(ctx: click.Context, url: str | None) -> None:
    """Read and write the tensor store."""
    ctx.obj = url


@store_group.command("ls")
@click.argument("prefix", default="")
def store_ls(prefix: str) -> None:
    """List the keys under PREFIX with their types and sizes."""
    with _store_errors():
        st = _store()
        rows = [(k, _type(i), i.nbytes, i.version, _when(i.written)) for k in st.keys(prefix) for i in [st.info(k)]]
    _table(f"{len(rows)} key(s) under {prefix!r}", ("key", "type", "bytes", "version", "written"), rows)


@store_group.command("info")
@click.argument("key")
def store_info(key: str) -> None:
    """Show KEY's type, size, checksum, version and when it was written."""
    with _store_errors():
        i = _store().info(key)
    _table(key, ("field", "value"), [("dtype", i.dtype), ("shape", list(i.shape)), ("bytes", i.nbytes),
                                     ("checksum", i.checksum), ("version", i.version), ("written", _when(i.written))])


# Printed in full by `get` without -o; past this, the tensor goes to a file.
MAX_PRINTED_ELEMENTS = 1000


@store_group.command("get")
@click.argument("key")
@click.option("-o", "--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="write the tensor to this .npy file")
def store_get(key: str, out: str | None) -> None:
    """Print KEY (small tensors) or write it to a .npy file (-o). Types .npy cannot name
    (bf16, f8, quantized) go through `dtm store export` instead."""
    import numpy as np

    from .errors import DTMError, ErrorCode as E
    from .ref import dequantize

    with _store_errors():
        st = _store()
        i = st.info(key)
        x = st.get_array(key)
        if out is None:
            if x.size > MAX_PRINTED_ELEMENTS:
                raise DTMError(E.ATTRIBUTE_TYPE, f"{key!r} is {_type(i)}, {x.size} elements: write it to a file "
                               "with -o FILE.npy")
            # numpy prints narrow floats and quantized blocks as bytes: show their f32 values
            shown = dequantize(x, i.dtype, np.float32) if i.dtype.is_quant else \
                x.astype(np.float32) if x.dtype.kind == "V" else x
            click.echo(f"{key}: {_type(i)}\n{shown}")
            return
        if i.dtype.is_quant or x.dtype.kind == "V":
            raise DTMError(E.UNKNOWN_DTYPE, f"{key!r} is {_type(i)}, which .npy cannot name: use "
                           f"`dtm store export {key} FILE.safetensors`")
        np.save(out, x, allow_pickle=False)
    click.echo(f"{key}: {_type(i)} -> {out}")


@store_group.command("put")
@click.argument("key")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dtype", default=None, help="store the array as this DTM dtype (e.g. q8_0 for its uint8 blocks)")
def store_put(key: str, file: str, dtype: str | None) -> None:
    """Store the .npy FILE under KEY (never unpickles)."""
    import numpy as np

    from .errors import DTMError, ErrorCode as E

    with _store_errors():
        try:
            x = np.load(file, allow_pickle=False)
        except ValueError:  # numpy's words for this advise unpickling, which DTM never does
            raise DTMError(E.BAD_ENCODING, f"{file}: not a .npy file of numbers") from None
        st = _store()
        st.put_array(key, x, dtype=dtype)
        i = st.info(key)
    click.echo(f"{key}: {_type(i)} <- {file}")


@store_group.command("rm")
@click.argument("keys", nargs=-1, required=True)
def store_rm(keys: tuple[str, ...]) -> None:
    """Delete KEYS: all of them, or none when one is missing (every missing key named), so
    that a typo leaves the store as it was and the command can simply be run again."""
    from .errors import DTMError, ErrorCode as E

    with _store_errors():
        st = _store()
        missing = [k for k in keys if k not in st]
        if missing:
            raise DTMError(E.STORE_KEY_MISSING, f"no tensor is stored under {', '.join(map(repr, missing))}; "
                           "nothing was deleted")
        for k in keys:
            st.delete(k)


@store_group.command("du")
@click.argument("prefix", default="")
def store_du(prefix: str) -> None:
    """Keys and bytes under PREFIX, and the bytes of unfinished versions there (puts in
    flight, or left by killed ones until `dtm store gc` or the next open removes them)."""
    with _store_errors():
        st = _store()
        keys = st.keys(prefix)
        used, garbage = st.du(prefix), st.du(prefix, garbage=True)
    _table(f"usage under {prefix!r}", ("prefix", "keys", "bytes", "unfinished bytes"),
           [(prefix, len(keys), used, garbage)])


@store_group.command("gc")
def store_gc() -> None:
    """Remove every version no key names and no live writer holds (left by killed puts)."""
    with _store_errors():
        removed = _store().collect(older_than_s=0)
    click.echo(f"{len(removed)} unfinished version(s) removed")


@store_group.command("recover")
def store_recover() -> None:
    """Rebuild a lost or damaged index from the versions on disk (each key's newest complete
    one). Tensors kept inline in the index cannot be recovered. Run it while nothing writes."""
    from . import store
    from .store.format import INLINE_BYTES

    with _store_errors():
        report = store.recover(click.get_current_context().obj)
    lost = (f"{report.inline_lost} tensor(s) kept inline in the old index are lost" if report.inline_lost is not None
            else f"tensors kept inline in the index (<= {INLINE_BYTES} bytes) cannot be recovered; how many there "
                 "were is unknown, the old index being unreadable")
    for rel, why in report.skipped:
        click.echo(f"skipped {rel}: {why}")
    click.echo(f"{report.keys} key(s) recovered, {report.quotas} quota(s) kept; {lost}")


@store_group.command("verify")
@click.argument("prefix", default="")
def store_verify(prefix: str) -> None:
    """Read every chunk under PREFIX and check its CRC32C; exit 1 when one fails."""
    with _store_errors():
        report = _store().verify(prefix)
    if report.bad:
        _table(f"verify {prefix!r}: bad chunks", ("key", "chunk", "problem"), report.bad)
    click.echo(f"{report.keys} key(s), {report.chunks} chunk(s) checked, {len(report.bad_keys)} bad key(s)")
    sys.exit(0 if report.ok else 1)


@store_group.command("export")
@click.argument("key_or_prefix")
@click.argument("out", type=click.Path(dir_okay=False))
def store_export(key_or_prefix: str, out: str) -> None:
    """Write a key, or every key under a prefix, to the safetensors file OUT (tensor names =
    keys). Quantized types have no safetensors dtype: they are refused, not written as bytes."""
    from .errors import DTMError, ErrorCode as E
    from .nn.weights import save_safetensors

    with _store_errors():
        st = _store()
        keys = st.keys(key_or_prefix)
        keys = [key_or_prefix] if key_or_prefix in keys else keys  # a whole key, not the keys it prefixes
        if not keys:
            raise DTMError(E.STORE_KEY_MISSING, f"no key is {key_or_prefix!r} or starts with it")
        for k in keys:
            if st.info(k).dtype.is_quant:
                raise DTMError(E.UNKNOWN_DTYPE, f"{k!r} is {_type(st.info(k))}: safetensors has no quantized "
                               "dtypes; nothing was written")
        save_safetensors({k: st.get_array(k) for k in keys}, out)
    click.echo(f"{len(keys)} tensor(s) -> {out}")


@store_group.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--prefix", default="", help="put each tensor under PREFIX + its name")
def store_import(file: str, prefix: str) -> None:
    """Store every tensor of the safetensors FILE under its name (bf16 and f8 included)."""
    from .nn.weights import read_safetensors

    with _store_errors():
        tensors, _ = read_safetensors(file)
        st = _store()
        for name, t in tensors.items():
            st.put_array(prefix + name, t.numpy())
    click.echo(f"{len(tensors)} tensor(s) <- {file}")


# --- task graphs ---------------------------------------------------------------------------

@main.group("checkpoint")
def checkpoint_group() -> None:
    """List, describe and verify checkpoints (dtm.checkpoint, spec 9.4)."""


@checkpoint_group.command("ls")
@click.argument("directory", type=click.Path())
def checkpoint_ls(directory: str) -> None:
    """List the complete checkpoints under DIRECTORY, oldest first."""
    from . import ckpt

    with _store_errors():
        found = ckpt.list(directory)
    _table(f"{len(found)} checkpoint(s) in {directory}", ("step", "written", "bytes", "tensors", "mesh", "dtm"),
           [(c.step, _when(c.time), c.size, c.tensors, c.mesh or "-", c.dtm_version) for c in found])


@checkpoint_group.command("info")
@click.argument("directory", type=click.Path())
@click.option("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
def checkpoint_info(directory: str, step: int | None) -> None:
    """Show a checkpoint's versions, state and tensors (type, mesh and placements at save time)."""
    from . import ckpt

    with _store_errors():
        doc = ckpt.read_manifest(directory, step)
    click.echo(f"step {doc['step']}, written {_when(doc['time'])}, {doc['bytes']} bytes, format "
               f"{doc.get('format_version')}, DTM {doc.get('dtm_version')}, spec {doc.get('spec_version')}")
    click.echo("state: " + ", ".join(f"{k} ({v.get('kind')})" for k, v in doc["state"].items()))
    _table(f"{len(doc['tensors'])} tensor(s)", ("tensor", "type", "mesh", "placements", "chunks", "bytes"),
           [(t["name"], f"{t['dtype']}{t['shape']}",
             " x ".join(f"{a}={n}" for a, n in t["mesh"]["axes"]) if t.get("mesh") else "-",
             ", ".join(t["placements"]) if t.get("placements") else "-", len(t["chunks"]), t.get("nbytes", ""))
            for t in doc["tensors"]])


@checkpoint_group.command("verify")
@click.argument("directory", type=click.Path())
@click.option("--step", type=int, default=None, help="only this step (default: every complete checkpoint)")
def checkpoint_verify(directory: str, step: int | None) -> None:
    """Re-read every chunk and check its length and CRC32C against the chunk and the
    manifest; exit 1 naming each bad chunk."""
    from . import ckpt

    with _store_errors():
        report = ckpt.verify(directory, step)
    if report.bad:
        _table("bad chunks", ("step", "tensor", "file", "problem"), report.bad)
    click.echo(f"{report.checkpoints} checkpoint(s), {report.tensors} tensor(s), {report.chunks} chunk(s) checked, "
               f"{len(report.bad)} bad chunk(s)")
    sys.exit(0 if report.ok else 1)


@checkpoint_group.command("export")
@click.argument("directory", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
def checkpoint_export(directory: str, out: str, step: int | None) -> None:
    """Write each tensor group of a checkpoint as OUT/<group>.safetensors; a GPT-2 saved as a
    model (its config recorded) as OUT/<group>/, a directory transformers' from_pretrained reads."""
    from . import ckpt
    from .models.gpt2 import GPT2, GPT2Config

    with _store_errors():
        doc = ckpt.read_manifest(directory, step)
        for group, file in ckpt.export(directory, out, doc["step"]).items():
            config = doc["state"][group].get("hf_config")
            if config is not None and config.get("model_type") == "gpt2":
                model = GPT2(GPT2Config.from_hf(config), init=False)
                ckpt.load({group: model}, directory, step=doc["step"], strict=False)
                model.save_pretrained(os.path.join(out, group))
                os.remove(file)
                file = os.path.join(out, group)
            click.echo(f"{group} -> {file}")


@main.group("tasks")
def tasks_group() -> None:
    """Run task graphs over the tensor store."""


@tasks_group.command("run")
@click.argument("file")
@click.option("--store", "url", default=None, metavar="PATH|URL", help="the store the tasks read and write "
              "(as dtm.store.open takes; default DTM_STORE, else ~/.cache/dtm/store)")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="threads (default: the CPU count)")
@click.option("--kernels", default=None, metavar="cpu|ref", help="the backend that runs each function "
              "(default DTM_BACKEND, else cpu)")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="seconds to wait for the whole graph")
@click.option("--progress/--no-progress", default=None, help="a progress bar (default: when stderr is a terminal)")
def tasks_run(file: str, url: str | None, workers: int | None, kernels: str | None, timeout: float,
              progress: bool | None) -> None:
    """Run every `task` of the IR module FILE; print each task's time, worker and bytes."""
    from . import store, tasks

    module = _load(file)
    with _store_errors():
        st = store.open(url)
        run = tasks.Graph.from_module(module, st, kernels).run(workers, progress=progress)
        try:
            report = run.wait(timeout)
        finally:
            report = run.report()
            _table(report.summary(), ("task", "state", "worker", "seconds", "read", "written"),
                   [(t.name, t.state, t.worker or "-", f"{t.seconds:.4f}", t.bytes_read, t.bytes_written)
                    for t in report.tasks])


# --- data ingest and the live view --------------------------------------------------------

def _expand(paths: tuple[str, ...]) -> list[str]:
    """Files as given, and every file under a directory, sorted (a stable shard order)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(os.path.join(d, f) for d, _, files in os.walk(p) for f in files)
        else:
            out.append(p)
    return out


@main.command("ingest")
@click.argument("paths", nargs=-1, required=True)
@click.option("--fn", "fn_name", default="dtm.data.tokenize:word_tokens", show_default=True, metavar="MODULE:FUNC",
              help="function from a file's bytes to a 1-D array (imported by name in each worker)")
@click.option("--prefix", required=True, help="store prefix for the shards and the manifest")
@click.option("--store", "url", default=None, metavar="PATH|URL", help="the store (default: DTM_STORE, else "
              "~/.cache/dtm/store)")
@click.option("-j", "--workers", type=click.IntRange(min=0), default=os.cpu_count() or 1, show_default=True,
              help="worker processes (0: in this process)")
@click.option("--retries", type=click.IntRange(min=0), default=1, show_default=True,
              help="times a file is retried when its worker dies")
def ingest_cmd(paths: tuple[str, ...], fn_name: str, prefix: str, url: str | None, workers: int,
               retries: int) -> None:
    """Turn each file of PATHS (directories: every file under them) into a shard under PREFIX,
    showing each worker's CPU, memory, files and bytes as it goes."""
    import time

    from rich.console import Group
    from rich.text import Text

    from . import data
    from .cluster.top import Snapshot, human_bytes, live_view, table, table_console
    from .data.fnref import resolve

    console = table_console(stderr=True)
    prev: list[Snapshot] = []

    def show(p: data.Progress) -> None:
        snap = Snapshot(time.monotonic(), {r.name: r for r in p.workers})
        rate = p.read_bytes / max(p.elapsed_s, 1e-9) / 1e6
        head = Text(f"ingest {prefix}: {p.files_done}/{p.files_total} files, {human_bytes(p.read_bytes)} read, "
                    f"{rate:.1f} MB/s, {p.elapsed_s:.0f} s")
        live.update(Group(head, table(snap, prev[-1] if prev else None, ops_name="files", key_name="worker")), refresh=True)
        prev[:] = [snap]

    with _store_errors():
        fn = resolve(fn_name)
        start = time.monotonic()
        with live_view(console) as live:
            m = data.ingest(_expand(paths), fn, prefix, workers=workers, store=url, retries=retries, progress=show)
        took = time.monotonic() - start
    click.echo(f"{len(m.shards)} shard(s), {m.elements} element(s) from {human_bytes(m.read_bytes)} in {took:.1f} s "
               f"({m.read_bytes / took / 1e6:.1f} MB/s) -> {prefix}/manifest")


@main.command("cancel")
@click.option("--coordinator", "address", default=None, metavar="HOST:PORT",
              help="the job's coordinator (DTM_TOKEN must be its token); default: the newest job on this machine")
@click.option("--reason", default="cancelled from the command line", show_default=True,
              help="why: every rank's Cancelled error quotes it")
def cancel_cmd(address: str | None, reason: str) -> None:
    """Cancel a running job (spec 9.4.10): every rank's current collective, transfer, store
    request and checkpoint save ends with Cancelled (E1007) naming the command line and
    the reason, and so does every later one."""
    from .cluster import jobfile
    from .cluster.env import parse_address
    from .cluster.membership import cancel_job
    from .errors import DTMError

    try:
        if address is None:
            jobs = jobfile.find()
            if not jobs:
                raise click.ClickException("no running job found on this machine (dtm launch announces its own); "
                                           "name one with --coordinator HOST:PORT and DTM_TOKEN")
            address, token = str(jobs[0]["coordinator"]), bytes.fromhex(str(jobs[0].get("token", "")))
        else:
            token = os.environ.get("DTM_TOKEN", "").encode()
        if not token:
            raise click.ClickException(f"no cluster token for the coordinator at {address}: set DTM_TOKEN")
        click.echo(f"dtm cancel: {cancel_job(parse_address(address, '--coordinator'), token, reason)}")
    except ValueError:
        raise click.ClickException("the newest job file's token is not hex: name the job with --coordinator "
                                   "HOST:PORT and DTM_TOKEN") from None
    except DTMError as e:
        raise click.ClickException(str(e)) from None


@main.command("top")
@click.option("--coordinator", "address", default=None, metavar="HOST:PORT",
              help="the coordinator's metrics address (default: the newest job on this machine)")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="seconds between refreshes")
@click.option("--once", is_flag=True, help="print one frame and exit")
def top_cmd(address: str | None, interval: float, once: bool) -> None:
    """A live view of a running job's ranks: CPU, memory, operations and bytes with their
    rates, state, and when each was last heard. Ends with the job or Ctrl-C."""
    from .cluster import top
    from .errors import DTMError

    address = address or top.find_local()
    if address is None:
        raise click.ClickException("no running job found on this machine (dtm launch and dtm coordinator announce "
                                   "theirs); name one with --coordinator HOST:PORT")
    try:
        why = top.run(address, interval=interval, iterations=1 if once else None)
    except DTMError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"dtm top: {why}", err=True)

if __name__ == "__main__":
    main()
