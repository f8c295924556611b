"""
configurator.py: settings from the command line, stated once.

Every setting is a dataclass field made with setting(): its default, its one-line help, and its
valid values (choices, or a range for numbers) live together, and check() enforces them for every
field alike, so a new setting is checked the moment it is declared. parse() reads nanoGPT-style
command lines: the defaults, then config/*.py files of plain assignments, then --name value.

    python train.py config/cpu_tiny.py --readout raw --per_loop_ce --no_always_save_checkpoint

A command ends with one line on stderr, never a traceback: UsageError (the settings are wrong,
exit 2) or RunError (the run cannot go on: a missing file, offline, a bad checkpoint; exit 1).
"""
import math
import os
import re
import signal
import sys
from dataclasses import MISSING, field, fields


class UsageError(ValueError):
    """Bad settings: one line, exit 2."""


class RunError(Exception):
    """The run cannot go on (missing file, offline, bad checkpoint): one line, exit 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a job scheduler, torchrun), raised wherever Ctrl-C raises KeyboardInterrupt: every phase
    stops the same way for both signals, with exit 143 instead of 130."""


def interrupt(sig, _frame=None):
    """A signal handler: raise what the signal means, KeyboardInterrupt (SIGINT) or Terminated (SIGTERM)."""
    raise Terminated() if sig == signal.SIGTERM else KeyboardInterrupt()


def setting(default, help, choices=None, lo=None, hi=None, above=None, type=None):
    """A dataclass field with its help and its valid values: choices, or lo <= value <= hi
    (above: value > above). Floats must also be finite. A default of None means "decided later"
    (the help says by what); then type names the type a given value must have."""
    return field(default=default, metadata=dict(help=help, choices=choices, lo=lo, hi=hi, above=above,
                                                type=type or (None if default is None else default.__class__)))


def check(obj, only=None):
    """Raise UsageError naming the first field of obj (a dataclass made with setting()) whose value
    is not valid. only: check just these names."""
    for f in fields(obj):
        if only is not None and f.name not in only:
            continue
        v, m = getattr(obj, f.name), f.metadata
        typ = m.get("type") if f.default is not MISSING else None
        if v is None and f.default is None:
            continue
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
            setattr(obj, f.name, v)
        if typ is not None and (not isinstance(v, typ) or (typ is int and isinstance(v, bool))):
            raise UsageError(f"--{f.name} expects {typ.__name__}, got {v!r}")
        if m.get("choices") and v not in m["choices"]:
            raise UsageError(f"--{f.name} {v!r} is invalid; choose one of {', '.join(map(str, m['choices']))}")
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"--{f.name} {v} is invalid; it must be a finite number")
        lo, hi, above = m.get("lo"), m.get("hi"), m.get("above")
        if (lo is not None and v < lo) or (hi is not None and v > hi) or (above is not None and v <= above):
            raise UsageError(f"--{f.name} {v} is invalid; it must be {valid_range(m)}")


def check_device(device, auto=True):
    """auto (if allowed), cpu, cuda or cuda:N; anything else is one line."""
    if not ((auto and device == "auto") or re.fullmatch(r"cpu|cuda(:\d+)?", device)):
        raise UsageError(f"--device {device} is not supported; use {'auto, ' if auto else ''}cpu, cuda or cuda:N")


def valid_range(m):
    """'>= 0 and <= 1' from a field's metadata ('' when it has no bounds)."""
    return " and ".join(s for s in ((f">= {m['lo']}" if m.get("lo") is not None else ""),
                                    (f"> {m['above']}" if m.get("above") is not None else ""),
                                    (f"<= {m['hi']}" if m.get("hi") is not None else "")) if s)


def coerce(name, v, f):
    """A value from the command line (a string) or a config file, as the field's type."""
    typ = f.metadata.get("type") or type(f.default)
    if isinstance(v, str) and typ is not str:
        try:
            return {"true": True, "false": False}[v.lower()] if typ is bool else typ(v)
        except (ValueError, KeyError):
            raise UsageError(f"--{name} expects {typ.__name__}, got {v!r}") from None
    return v


def parse(argv, classes, help_text):
    """Defaults < config files < --options, for the fields of `classes` (dataclasses made with
    setting()). Returns ({name: value}, the set of names given explicitly). Values are coerced to
    their field's type; check() them once the dataclasses are built."""
    spec = {f.name: f for c in classes for f in fields(c)}
    values = {k: f.default for k, f in spec.items()}
    given, i = set(), 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print_help(help_text, classes)
            raise SystemExit(0)
        if not a.startswith("--"):  # a config file of plain assignments
            if not os.path.isfile(a):
                raise UsageError(f"config file {a} not found; presets are in config/")
            scope = {}
            try:
                exec(open(a).read(), {}, scope)
            except Exception as e:  # a typo in a preset: say where, not a traceback
                raise UsageError(f"config file {a} failed: {type(e).__name__}: {e}") from None
            for k, v in scope.items():
                if not k.startswith("_"):
                    values[known(k, spec, where=a)] = coerce(k, v, spec[known(k, spec, where=a)])
            i += 1
            continue
        name, eq, inline = a[2:].partition("=")
        is_bool = lambda k: k in spec and spec[k].metadata.get("type") is bool
        key = name[3:] if name.startswith("no_") and is_bool(name[3:]) else known(name, spec)
        if is_bool(key):  # --name, --no_name, or --name=true/false
            value = coerce(key, inline, spec[key]) if eq else True
            values[key] = value if key == name else not value
            i += 1
        else:
            if not eq and i + 1 >= len(argv):
                raise UsageError(f"--{name} needs a value")
            values[key] = coerce(key, inline if eq else argv[i + 1], spec[key])
            i += 1 if eq else 2
        given.add(key)
    return values, given


def known(name, spec, where="option"):
    if name in spec:
        return name
    raise UsageError(f"unknown {'option --' if where == 'option' else where + ': setting '}{name}; "
                     "see --help")


def print_help(text, classes):
    print(text.strip() + "\n\noptions (booleans: --name, --no_name or --name=true|false):")
    for c in classes:
        print(f"\n  {c.__doc__.strip().splitlines()[0]}")
        for f in fields(c):
            m = f.metadata
            if not m.get("help"):  # internal
                continue
            valid = " | ".join(map(str, m["choices"])) if m.get("choices") else valid_range(m)
            print(f"    --{f.name:<28} {m['help']}" + (f" ({valid})" if valid else "")
                  + (f" [{f.default!r}]" if f.default is not None else ""))


class QuietPipe:
    """sys.stdout that goes quiet when its reader is gone (python train.py | head): a closed pipe must
    not stop a training run or end a command with a traceback."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.stream = open(os.devnull, "w")
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.stream = open(os.devnull, "w")

    def __getattr__(self, name):
        return getattr(self.stream, name)


def command(name, body, interrupted=lambda: "interrupted"):
    """Run a command line's body the way every looplm command ends: UsageError -> one line, exit 2;
    RunError -> one line, exit 1; Ctrl-C -> interrupted() as one line, exit 130, and SIGTERM the same
    with exit 143 (in every phase: its default would end the process without a word); a closed stdout
    pipe -> quiet. Both handlers are set, so a run started in the background (where the shell ignores
    SIGINT) still stops cleanly on it. Returns the exit code."""
    if not isinstance(sys.stdout, QuietPipe):
        sys.stdout = QuietPipe(sys.stdout)
    old_handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return body() or 0
    except UsageError as e:
        code, msg = 2, f"error: {e}"
    except RunError as e:
        code, msg = 1, f"error: {e}"
    except KeyboardInterrupt as e:
        code, msg = 143 if isinstance(e, Terminated) else 130, interrupted()
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
    print(f"{name}: {msg}", file=sys.stderr)
    return code
