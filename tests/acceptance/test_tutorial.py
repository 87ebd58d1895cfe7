"""docs/tutorial.md, followed as a reader follows it: every block of the page in order, in a new directory, with
only the marked lines of its `tutorial.env` edited (this run's Postgres, Kafka, checkout and a free port).

- A ```sh block runs in bash from the tutorial's directory, with `tutorial.env` sourced as the reader's first
  terminal has it; it must exit 0. A comment line of its own after a command is the output the reader is told to
  expect (`...` matches anything): one line of the block's output must match it.
- A ```sh block headed `# terminal "NAME"` starts in the background and keeps running, as a terminal of its own.
- A ```python block headed `# path` is that file of the project (`# append to path` appends); one with no such
  head is what the directive before it inserts into a file.
- `<!-- tutorial: ... -->` comments, which the site does not show, do what the prose asks of the reader: wait for
  a terminal to say something, press Ctrl-C in one, edit a file, open a page of the admin.

It needs the network a reader needs: `pip install` of the wheel fetches Django, psycopg and confluent-kafka.

Slow: the whole tutorial, command after command, with the replicas' fail-over and a queue consumer waited for
as a reader waits for them.
"""

from __future__ import annotations

import fnmatch
import http.cookiejar
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.fresh_project import user_env

# the tutorial as written: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres_agnostic]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorial.md"
FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!-- tutorial: (.*) -->$")
#: What a directive may call: the Reader's methods of these names.
DIRECTIVES = ("wait_for", "ctrl_c", "edit", "admin_page", "eventually")


@dataclass
class Block:
    kind: str  # "sh", "python" or "directive"
    text: str
    line: int


def blocks(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        if (directive := DIRECTIVE.match(lines[i])) is not None:
            found.append(Block("directive", directive.group(1), i + 1))
        elif (fence := FENCE.match(lines[i])) is not None and fence.group(1):
            end = lines.index("```", i + 1)
            found.append(Block(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1))
            i = end
        i += 1
    return found


@dataclass
class Terminal:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Reader:
    """The reader at the keyboard: the tutorial's directory, its terminals, what they typed into files."""

    home: Path
    env: dict[str, str]
    edits: dict[str, str]
    terminals: dict[str, Terminal] = field(default_factory=dict)
    pending_edit: dict[str, object] | None = None
    #: Seconds the next sh block may take to come true (`eventually`): the reader looks again meanwhile.
    retry_for: float = 0.0

    @property
    def project(self) -> Path:
        return self.home / "outbox-tutorial"

    def bash(self, script: str, where: str) -> str:
        cwd = self.project if self.project.exists() else self.home
        prelude = ". ./tutorial.env\n" if (cwd / "tutorial.env").exists() else ""
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", prelude + script], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{where}: exit {done.returncode}\n{script}\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    def sh(self, block: Block) -> None:
        script = self.edit_marked_lines(block.text)
        head = script.splitlines()[0]
        if (terminal := re.match(r'# terminal "([^"]+)"', head)) is not None:
            self.open_terminal(terminal.group(1), script, block.line)
            return
        deadline, self.retry_for = time.monotonic() + self.retry_for, 0.0
        while True:
            try:
                output = self.bash(script, f"tutorial.md:{block.line}")
                for expected in expected_lines(script):
                    assert any(fnmatch.fnmatchcase(line.strip(), expected.replace("[", "[[]"))
                               for line in output.splitlines()), \
                        f"tutorial.md:{block.line}: no line of the output is {expected!r}:\n{output}"
                return
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1)

    def edit_marked_lines(self, script: str) -> str:
        """The lines between ▼ and ▲ are the reader's to edit: this run's values."""
        if "# ▼" not in script:
            return script
        for name, value in self.edits.items():
            script, count = re.subn(rf"^export {name}=\S+", f"export {name}={value}", script, flags=re.M)
            assert count == 1, f"tutorial.env has no line `export {name}=...` to edit"
        return script

    def open_terminal(self, name: str, script: str, line: int) -> None:
        log = self.home / f"terminal-{name.replace(' ', '-')}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(["bash", "-c", f"exec 2>&1\n{script}"], cwd=self.project, env=self.env,
                                       stdout=out, stdin=subprocess.DEVNULL, start_new_session=True,
                                       preexec_fn=_as_in_a_terminal)
        self.terminals[name] = Terminal(name, process, log)
        time.sleep(0.5)
        assert process.poll() is None, f"tutorial.md:{line}: terminal {name!r} exited at once:\n{log.read_text()}"

    def python(self, block: Block) -> None:
        head = block.text.splitlines()[0]
        if self.pending_edit is not None:
            self.insert(block.text)
            return
        match = re.match(r"# (append to )?([\w/.]+\.py)\b", head)
        assert match is not None, f"tutorial.md:{block.line}: a Python block names no file and no edit asks for it"
        path = self.project / match.group(2)
        with path.open("a" if match.group(1) else "w") as out:
            out.write(("\n" if match.group(1) else "") + block.text)

    # The directives: what the prose asks the reader to do.

    def wait_for(self, name: str, text: str, times: int = 1, timeout: float = 120) -> None:
        """Until terminal `name` has said `text` `times` times (runserver says it again after each reload)."""
        terminal, deadline = self.terminals[name], time.monotonic() + timeout
        while terminal.output().count(text) < times:
            assert terminal.process.poll() is None, f"terminal {name!r} exited:\n{terminal.output()}"
            assert time.monotonic() < deadline, f"terminal {name!r} did not say {text!r} {times} time(s) in " \
                                                f"{timeout} s:\n{terminal.output()}"
            time.sleep(0.2)

    def eventually(self, seconds: float) -> None:
        """The next block comes true within `seconds`: the page tells the reader to look again if not yet."""
        self.retry_for = seconds

    def ctrl_c(self, name: str, says: str = "", timeout: float = 60) -> None:
        terminal = self.terminals.pop(name)
        os.killpg(terminal.process.pid, signal.SIGINT)
        try:
            terminal.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(terminal.process.pid, signal.SIGKILL)
            terminal.process.wait()
            raise AssertionError(f"terminal {name!r} did not stop on Ctrl-C:\n{terminal.output()}") from None
        assert says in terminal.output(), f"terminal {name!r} did not say {says!r}:\n{terminal.output()}"

    def edit(self, path: str, after: str, replace: tuple[str, str] | None = None) -> None:
        self.pending_edit = {"path": path, "after": after, "replace": replace}

    def insert(self, text: str) -> None:
        edit, self.pending_edit = self.pending_edit, None
        assert edit is not None
        path = self.project / str(edit["path"])
        source = path.read_text()
        if edit["replace"] is not None:
            old, new = edit["replace"]  # type: ignore[misc]
            assert old in source, f"{path.name} has no {old!r} to replace"
            source = source.replace(old, new)
        anchor = str(edit["after"])
        at = source.index(anchor) + len(anchor)
        at = source.index("\n", at) + 1
        path.write_text(source[:at] + text + source[at:])

    def admin_page(self, path: str, *texts: str) -> None:
        """Log in as the tutorial's admin and open a page, as the reader does in a browser."""
        base = f"http://127.0.0.1:{self.edits['WEB_PORT']}"
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        opener.open(f"{base}/admin/login/", timeout=30).read()
        token = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
        form = urllib.parse.urlencode({"username": "admin", "password": "tutorial-admin",
                                       "csrfmiddlewaretoken": token, "next": path}).encode()
        request = urllib.request.Request(f"{base}/admin/login/", data=form, headers={"Referer": base + "/"})
        page = opener.open(request, timeout=30).read().decode()
        for text in texts:
            assert text in page, f"{path} does not show {text!r}"

    def tails(self, lines: int = 30) -> str:
        """The last lines of every terminal, for a failure's message."""
        return "".join(f"\n--- terminal {name!r} (last {lines} lines) ---\n"
                       + "\n".join(terminal.output().splitlines()[-lines:])
                       for name, terminal in self.terminals.items())

    def stop_all(self) -> None:
        for terminal in self.terminals.values():
            if terminal.process.poll() is None:
                os.killpg(terminal.process.pid, signal.SIGKILL)
                terminal.process.wait()
        self.terminals.clear()


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it: a pytest-xdist worker runs with SIGINT ignored, which its children would
    inherit (an ignored signal stays ignored across exec), and `runserver` would never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def expected_lines(script: str) -> list[str]:
    """Comment lines after the block's first command: the output the page says the reader will see (none in a
    block that writes a file: its comments are the file's)."""
    if "<<" in script:
        return []
    lines, seen_command, expected = script.splitlines(), False, []
    for line in lines:
        if line.startswith("# ") and seen_command:
            expected.append(line[2:].strip().replace("...", "*"))
        elif line.strip() and not line.startswith("#"):
            seen_command = True
    return expected


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.xdist_group("wheel")  # builds the wheel in the checkout, as the wheel_venv fixture does: one at a time
@pytest.mark.skipif(shutil.which("psql") is None or shutil.which("curl") is None,
                    reason="the tutorial needs psql and curl")
def test_the_tutorial_runs_as_written(services, bootstrap_servers, tmp_path):
    server = services.database_url.rsplit("/", 1)[0]  # the role and server, no database: the tutorial adds its own
    env = {**user_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # the tutorial's own file sets it
    reader = Reader(tmp_path, env, {"PG_SERVER": server, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
                                    "OUTBOX_SRC": str(ROOT),
                                    "PYTHON": sys.executable, "WEB_PORT": str(free_port())})
    steps = blocks(PAGE)
    assert sum(step.kind == "sh" for step in steps) > 10 and any(step.kind == "directive" for step in steps)
    run_suffix = None
    try:
        for step in steps:
            if step.kind == "sh":
                reader.sh(step)
            elif step.kind == "python":
                reader.python(step)
            elif step.kind == "directive":
                eval(step.text, {name: getattr(reader, name) for name in DIRECTIVES})  # the page's own
            if run_suffix is None and (reader.project / "tutorial.env").exists():
                run_suffix = re.search(r"export RUN=(\w+)", (reader.project / "tutorial.env").read_text())
        assert reader.pending_edit is None, "an edit directive found no Python block to insert"
    except AssertionError as failure:
        raise AssertionError(f"{failure}{reader.tails()}") from None
    finally:
        reader.stop_all()
        if run_suffix is not None:  # the reader's last step drops it; a failed run leaves it to us
            services.drop_database(f"tutorial_{run_suffix.group(1)}")
