"""Builds libkk's C library: `python bindings_c/build.py [--out DIR]`.

Writes DIR/libkk.so (cffi embedding mode: the exported functions of include/libkk.h, written in
abi.c and runtime.c, with the Python half, _marshal.py and _embedded.py, embedded as start-up
code) and copies DIR/libkk.h next to it. Link with `-I DIR -L DIR -lkk -Wl,-rpath,DIR` with DIR
absolute (a relative rpath is read from the directory the program runs in), or dlopen
DIR/libkk.so.

The library is linked against the shared libpython of the Python that runs this script, and by
default (kk_runtime_init(NULL)) starts that same Python environment.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = HERE / "include" / "libkk.h"
DEFAULT_OUT = HERE.parent / "build" / "libkk"

# The Python half: cffi defines these as static C functions whose bodies are the
# @ffi.def_extern functions of _embedded.py; abi.c calls them. _kk_set_error is plain C (abi.c)
# that _embedded.py calls to leave a message for kk_last_error().
_EXTERN_PYTHON = """
extern "Python" {
    int _kk_py_init_check(void);
    int _kk_py_shutdown(void);
    void _kk_py_flush(void);
    int _kk_py_runtime_info(int format, char *buffer, size_t capacity, size_t *length);
    int _kk_py_session_create(const kk_session_params *params, uint64_t *out_handle);
    int _kk_py_session_free(uint64_t handle);
    int _kk_py_session_info(uint64_t handle, int format, char *buffer, size_t capacity,
                            size_t *length);
    int _kk_py_tokenize(uint64_t handle, const char *text, bool add_special_tokens,
                        int32_t *token_ids, size_t capacity, size_t *n_tokens);
    int _kk_py_detokenize(uint64_t handle, const int32_t *token_ids, size_t n_tokens,
                          bool skip_special_tokens, char *text, size_t capacity,
                          size_t *text_len);
    int _kk_py_generate(uint64_t handle, const kk_prompt *prompt,
                        const kk_request_params *params, kk_output *out);
    int _kk_py_submit(uint64_t handle, const kk_prompt *prompt,
                      const kk_request_params *params, uint64_t *out_id);
    int _kk_py_step(uint64_t handle, size_t *num_unfinished);
    int _kk_py_poll(uint64_t handle, uint64_t request_id, kk_output *out);
    int _kk_py_abort(uint64_t handle, uint64_t request_id);
}
void _kk_set_error(const char *message);
"""

# The Python half, in the order the start-up code runs it: module name, source file.
_MODULES = (("_libkk_marshal", "_marshal.py"), ("_libkk_embedded", "_embedded.py"))

# Runs as the start-up code of the embedded interpreter: makes each source a real module (their
# classes need one, and _embedded.py imports _marshal.py) and runs it.
_INIT_CODE = """
import sys
import types

for _name, _filename, _source in {modules!r}:
    _module = types.ModuleType(_name)
    _module.__file__ = _filename
    sys.modules[_name] = _module
    exec(compile(_source, _filename, "exec"), _module.__dict__)
"""


def header_types(header: str) -> str:
    """The header's typedefs (enums, structs, callbacks), in the C subset cffi's cdef reads."""
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    found = []
    for match in re.finditer(r"^typedef\b", text, flags=re.M):
        depth = 0
        for end in range(match.start(), len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
            elif text[end] == ";" and depth == 0:
                found.append(text[match.start() : end + 1])
                break
    return "\n".join(found)


def _c_string(value: str) -> str:
    out = []
    for byte in value.encode("utf-8"):
        char = chr(byte)
        if char in '\\"':
            out.append("\\" + char)
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _generated_defines() -> str:
    """Values baked into the library: the building Python, libkk's version, the sampling
    defaults (so kk_request_default_params() matches SamplingParams())."""
    from libkk import SamplingParams, __version__

    defaults = SamplingParams()
    values = {
        "KK_BUILD": "1",
        "KK_BUILD_PYTHON": _c_string(sys.executable),
        "KK_VERSION_STRING": _c_string(__version__),
        "KK_DEFAULT_MAX_TOKENS": str(-1 if defaults.max_tokens is None else defaults.max_tokens),
        "KK_DEFAULT_TEMPERATURE": repr(float(defaults.temperature)),
        "KK_DEFAULT_TOP_K": str(defaults.top_k),
        "KK_DEFAULT_TOP_P": repr(float(defaults.top_p)),
        "KK_DEFAULT_MIN_P": repr(float(defaults.min_p)),
        "KK_DEFAULT_REPETITION_PENALTY": repr(float(defaults.repetition_penalty)),
        "KK_DEFAULT_IGNORE_EOS": "true" if defaults.ignore_eos else "false",
    }
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def _check_python() -> Path:
    """The directory of the shared libpython to link against."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise SystemExit(
            f"build.py: {sys.executable} was built without a shared libpython "
            f"(Py_ENABLE_SHARED=0); an embedding library needs one. Rebuild that Python with "
            f"--enable-shared, e.g. `PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install "
            f"{sys.version.split()[0]}`, or use a distribution Python with libpython3.x.so."
        )
    return Path(libdir)


def build(out_dir: Path, *, verbose: bool = False) -> Path:
    """Builds libkk.so into out_dir, copies libkk.h beside it; returns the library's path."""
    import cffi

    libdir = _check_python()
    header = HEADER.read_text()

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(header_types(header))
    ffibuilder.cdef(_EXTERN_PYTHON)
    modules = [(name, str(HERE / file), (HERE / file).read_text()) for name, file in _MODULES]
    ffibuilder.embedding_init_code(_INIT_CODE.format(modules=modules))
    ffibuilder.set_source(
        "_libkk_c",
        _generated_defines() + (HERE / "abi.c").read_text() + (HERE / "runtime.c").read_text(),
        include_dirs=[str(HEADER.parent)],
        libraries=["dl", "pthread"],
        extra_compile_args=["-O2", "-fvisibility=hidden"],
        extra_link_args=[
            f"-Wl,-rpath,{libdir}",
            "-Wl,-soname,libkk.so",
            "-Wl,-z,nodelete",  # Python keeps pointers into the library: never unload it
            "-Wl,--no-undefined",
        ],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="libkk-build-") as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, target="libkk.*", verbose=verbose))
        library = out_dir / "libkk.so"
        tmp_library = out_dir / "libkk.so.tmp"
        shutil.copyfile(built, tmp_library)
        tmp_library.chmod(0o755)
        tmp_library.replace(library)  # atomic: a running host keeps its mapped copy
    shutil.copyfile(HEADER, out_dir / "libkk.h")
    return library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    library = build(args.out.resolve(), verbose=args.verbose)
    print(f"built {library}")
    print(f"header {library.parent / 'libkk.h'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
