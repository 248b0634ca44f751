"""The code the ``python`` tool's child process runs before the user's code (passed to ``python -I -c``).

It must stay self-contained (no jaxrl_hf imports: the child is started isolated). Arguments: ``argv[1]`` the
scratch directory, ``argv[2]`` CPU seconds, ``argv[3]`` address-space bytes, ``argv[4]`` max file bytes. The
user's code arrives on stdin. Order matters: limits, then the audit hook, then the user's code.
"""

CHILD_SOURCE = r'''
import os, resource, signal, sys, traceback
scratch, cpu_s, mem_bytes, file_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
source = sys.stdin.read()
sys.stdin.close()
for limit, soft, hard in ((resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, mem_bytes, mem_bytes),
                          (resource.RLIMIT_FSIZE, file_bytes, file_bytes), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(limit, (soft, hard))  # CPU: SIGXCPU at the soft limit, SIGKILL a second later
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with OSError instead of killing
os.chdir(scratch)
READABLE = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                         os.path.dirname(os.__file__)) if p}))
SCRATCH = os.path.realpath(scratch)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WRITE_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "os.chdir", "shutil.rmtree", "shutil.copyfile",
                          "shutil.move", "os.chflags"})
READ_EVENTS = frozenset({"os.listdir", "os.scandir", "glob.glob"})
BLOCKED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.system",
                    "os.kill", "os.killpg", "ctypes.", "resource.setrlimit", "resource.prlimit", "pty.",
                    "os.startfile", "urllib.", "http.", "ftplib.", "smtplib.", "imaplib.", "poplib.", "nntplib.",
                    "telnetlib.", "webbrowser.", "sys.remote_exec", "os.setuid", "os.setgid", "os.chroot")

def inside(path, roots):
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + os.sep) for root in roots)

def paths_of(args):
    for arg in args:
        if isinstance(arg, (str, bytes, os.PathLike)):
            yield os.fsdecode(arg)

BLOCKED_MODULES = frozenset({"_posixsubprocess"})  # fork_exec raises no audit event (subprocess, multiprocessing)

def hook(event, args, _inside=inside, _blocked=BLOCKED_PREFIXES, _modules=BLOCKED_MODULES, _writes=WRITE_EVENTS,
         _reads=READ_EVENTS, _scratch=(SCRATCH,), _readable=(SCRATCH,) + READABLE, _write=WRITE_FLAGS):
    if event.startswith(_blocked):
        raise PermissionError(f"sandbox: {event} is not allowed (no network, no processes, no native calls)")
    if event == "import" and args[0] in _modules:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed (it starts processes unaudited)")
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # an already open descriptor
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _write)
        if not _inside(os.fsdecode(path), _scratch if writes else _readable):
            raise PermissionError(f"sandbox: may not {'write' if writes else 'read'} {os.fsdecode(path)!r} "
                                  "(only files inside the scratch directory)")
    elif event in _writes or event in _reads:
        for path in paths_of(args):
            if not _inside(path, _scratch if event in _writes else _readable):
                raise PermissionError(f"sandbox: {event} outside the scratch directory: {path!r}")

sys.addaudithook(hook)
del hook
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    import ast
    tree = ast.parse(source, "<tool>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), namespace)
    if last is not None:  # like a notebook cell: show the last expression's value
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except BaseException as err:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == "<tool>"]
    where = f"line {frames[-1].lineno}: " if frames else ""
    sys.stderr.write(f"{where}{''.join(traceback.format_exception_only(type(err), err)).strip()}\n")
    sys.stdout.flush()
    sys.exit(1)
'''
