/*
 * Starting and stopping the embedded interpreter: kk_runtime_init, kk_runtime_info,
 * kk_runtime_shutdown.
 *
 * build.py compiles this file in one unit with abi.c, after it: it uses abi.c's error and state
 * helpers (kk_fail, kk_enter, kk_state) and the extern "Python" functions declared there.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static pthread_mutex_t kk_init_lock = PTHREAD_MUTEX_INITIALIZER; /* held by init and shutdown */
static char kk_python[PATH_MAX];   /* the executable the interpreter was started from */
static int kk_owns_interpreter;    /* libkk started Python (no host interpreter was running) */
static pthread_t kk_init_thread;   /* the thread that started it: Python's main thread */

/* Which executable to start from: the argument, else $LIBKK_PYTHON, else the building Python.
   Made absolute but not resolved: a virtualenv's python is a symlink, and resolving it would
   leave the virtualenv. */
static kk_status kk_choose_python(const char *requested, char *chosen, size_t capacity) {
    const char *source = "python_executable";
    const char *path = requested;
    if (path == NULL) {
        path = getenv("LIBKK_PYTHON");
        source = "$LIBKK_PYTHON";
        if (path == NULL || path[0] == '\0') {
            path = KK_BUILD_PYTHON;
            source = "the Python that built libkk";
        }
    }
    if (path[0] == '\0') {
        return kk_fail(KK_ERR_INVALID_ARGUMENT,
                       "kk_runtime_init: python_executable is empty; pass NULL for the default");
    }
    int n;
    if (path[0] == '/') {
        n = snprintf(chosen, capacity, "%s", path);
    } else {
        char cwd[PATH_MAX];
        if (getcwd(cwd, sizeof cwd) == NULL) {
            return kk_fail(KK_ERR_INVALID_ARGUMENT,
                           "kk_runtime_init: cannot make %s '%s' absolute: %s", source, path,
                           strerror(errno));
        }
        n = snprintf(chosen, capacity, "%s/%s", cwd, path);
    }
    if (n < 0 || (size_t)n >= capacity) {
        return kk_fail(KK_ERR_INVALID_ARGUMENT, "kk_runtime_init: %s is too long", source);
    }
    struct stat info;
    if (stat(chosen, &info) != 0) {
        return kk_fail(KK_ERR_INVALID_ARGUMENT, "kk_runtime_init: %s '%s' does not exist: %s",
                       source, chosen, strerror(errno));
    }
    if (!S_ISREG(info.st_mode) || access(chosen, X_OK) != 0) {
        return kk_fail(KK_ERR_INVALID_ARGUMENT,
                       "kk_runtime_init: %s '%s' is not an executable file", source, chosen);
    }
    return KK_OK;
}

/* Not a virtualenv: the executable must belong to an installation of this Python version
   (<prefix>/bin/python with <prefix>/lib/pythonX.Y/os.py), or Python would quietly fall back to
   the installation libkk was built with. PYTHONHOME, if set, decides instead. */
static kk_status kk_check_installation(const char *executable) {
    const char *home = getenv("PYTHONHOME");
    if (home != NULL && home[0] != '\0') {
        return KK_OK;
    }
    char real[PATH_MAX];
    if (realpath(executable, real) == NULL) {
        return kk_fail(KK_ERR_INVALID_ARGUMENT, "kk_runtime_init: cannot resolve '%s': %s",
                       executable, strerror(errno));
    }
    char *slash = strrchr(real, '/');
    if (slash != NULL) {
        *slash = '\0'; /* <prefix>/bin */
        slash = strrchr(real, '/');
    }
    if (slash != NULL) {
        *slash = '\0'; /* <prefix> */
        static const char *const libdirs[] = {"lib", "lib64"};
        for (size_t i = 0; i < sizeof libdirs / sizeof libdirs[0]; i++) {
            char landmark[PATH_MAX + 64];
            snprintf(landmark, sizeof landmark, "%s/%s/python%d.%d/os.py", real, libdirs[i],
                     PY_MAJOR_VERSION, PY_MINOR_VERSION);
            if (access(landmark, R_OK) == 0) {
                return KK_OK;
            }
        }
    }
    return kk_fail(KK_ERR_INVALID_ARGUMENT,
                   "kk_runtime_init: '%s' is not a Python %d.%d installation or virtualenv (no "
                   "lib/python%d.%d beside its bin/ and no pyvenv.cfg); this libkk needs Python "
                   "%d.%d: pass that Python's executable or a virtualenv made from it",
                   executable, PY_MAJOR_VERSION, PY_MINOR_VERSION, PY_MAJOR_VERSION,
                   PY_MINOR_VERSION, PY_MAJOR_VERSION, PY_MINOR_VERSION);
}

/* The executable must be of this library's Python version: a virtualenv records its version in
   pyvenv.cfg (next to bin/ or to the executable); any other executable must belong to an
   installation of that version. */
static kk_status kk_check_python_version(const char *executable) {
    char directory[PATH_MAX];
    snprintf(directory, sizeof directory, "%s", executable);
    for (int level = 0; level < 2; level++) {
        char *slash = strrchr(directory, '/');
        if (slash == NULL) {
            return KK_OK;
        }
        *slash = '\0';
        char config[PATH_MAX + 16];
        snprintf(config, sizeof config, "%s/pyvenv.cfg", directory);
        FILE *file = fopen(config, "r");
        if (file == NULL) {
            continue;
        }
        char line[1024];
        kk_status status = KK_OK;
        while (fgets(line, sizeof line, file) != NULL) {
            char key[64];
            char value[256];
            if (sscanf(line, " %63[A-Za-z_] = %255s", key, value) != 2) {
                continue;
            }
            if (strcmp(key, "version") != 0 && strcmp(key, "version_info") != 0) {
                continue;
            }
            char expected[32];
            snprintf(expected, sizeof expected, "%d.%d.", PY_MAJOR_VERSION, PY_MINOR_VERSION);
            if (strncmp(value, expected, strlen(expected)) != 0) {
                status = kk_fail(KK_ERR_INVALID_ARGUMENT,
                                 "kk_runtime_init: the virtualenv of '%s' is Python %s (%s), but "
                                 "this libkk was built for Python %d.%d",
                                 executable, value, config, PY_MAJOR_VERSION, PY_MINOR_VERSION);
            }
            break;
        }
        fclose(file);
        return status;
    }
    return kk_check_installation(executable);
}


/* Extension modules (torch, msgspec, _cffi_backend) resolve Python's symbols globally. If the
   host dlopened libkk with RTLD_LOCAL, libpython came in locally: load it again, globally. */
static kk_status kk_promote_libpython(void) {
    Dl_info info;
    if (dladdr((void *)&Py_IsInitialized, &info) == 0 || info.dli_fname == NULL) {
        return kk_fail(KK_ERR_RUNTIME, "kk_runtime_init: cannot locate libpython (dladdr failed)");
    }
    void *library = dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (library == NULL) {
        library = dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL);
    }
    if (library == NULL) {
        const char *why = dlerror();
        return kk_fail(KK_ERR_RUNTIME, "kk_runtime_init: cannot load %s with global symbols: %s",
                       info.dli_fname, why ? why : "unknown error");
    }
    return KK_OK; /* the handle stays open for the life of the process */
}

static kk_status kk_status_of_pystatus(PyStatus status, const char *what) {
    return kk_fail(KK_ERR_RUNTIME, "kk_runtime_init: %s failed: %s%s%s", what,
                   status.func ? status.func : "", status.func ? ": " : "",
                   status.err_msg ? status.err_msg : "unknown error");
}

static kk_status kk_start_interpreter(const char *executable) {
    PyPreConfig preconfig;
    PyPreConfig_InitPythonConfig(&preconfig);
    preconfig.utf8_mode = 1;        /* UTF-8 for files, paths and streams, whatever the locale */
    preconfig.configure_locale = 0; /* the process locale is the host's: never setlocale() it */
    preconfig.coerce_c_locale = 0;  /* and never rewrite LC_CTYPE in the host's environment */
    PyStatus status = Py_PreInitialize(&preconfig);
    if (PyStatus_Exception(status)) {
        return kk_status_of_pystatus(status, "Python pre-initialization");
    }
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* SIGINT and friends stay the host's */
    config.parse_argv = 0;
    status = PyConfig_SetBytesString(&config, &config.program_name, executable);
    if (!PyStatus_Exception(status)) {
        /* Python's path calculation starts from sys.executable: a pyvenv.cfg beside it or one
           level up selects that virtualenv, as running the executable would. */
        status = PyConfig_SetBytesString(&config, &config.executable, executable);
    }
    if (!PyStatus_Exception(status)) {
        status = Py_InitializeFromConfig(&config);
    }
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        return kk_status_of_pystatus(status, "Python initialization");
    }
    PyEval_SaveThread(); /* release the GIL: every entry takes it when it calls into Python */
    return KK_OK;
}

/* cffi needs its backend module in the chosen environment before any libkk code can run; say
   so plainly rather than through cffi's traceback. */
static kk_status kk_check_cffi_backend(void) {
    kk_status status = KK_OK;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *module = PyImport_ImportModule("_cffi_backend");
    if (module != NULL) {
        Py_DECREF(module);
    } else {
        PyObject *type = NULL, *value = NULL, *traceback = NULL;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
        const char *why = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
        PyErr_Clear();
        PyObject *prefix = PySys_GetObject("prefix"); /* borrowed */
        const char *where = prefix != NULL ? PyUnicode_AsUTF8(prefix) : NULL;
        PyErr_Clear();
        status = kk_fail(KK_ERR_RUNTIME,
                         "kk_runtime_init: the Python environment at %s cannot import cffi (%s); "
                         "install libkk and its dependencies there",
                         where ? where : "?", why ? why : "unknown error");
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    }
    PyGILState_Release(gil);
    return status;
}

static void kk_at_exit(void) {
    if (__atomic_load_n(&kk_state, __ATOMIC_ACQUIRE) == KK_STATE_READY) {
        _kk_py_flush();
    }
}

KK_API kk_status kk_runtime_init(const char *python_executable) {
    kk_error_text[0] = '\0';
    pthread_mutex_lock(&kk_init_lock);
    kk_status status = KK_OK;
    char chosen[PATH_MAX];
    switch (kk_state) {
    case KK_STATE_READY:
        if (python_executable != NULL && !kk_owns_interpreter) {
            status = kk_fail(KK_ERR_INVALID_ARGUMENT,
                             "kk_runtime_init: libkk runs in the host's own Python interpreter; "
                             "pass NULL");
        } else if (python_executable != NULL) {
            status = kk_choose_python(python_executable, chosen, sizeof chosen);
            if (status == KK_OK && strcmp(chosen, kk_python) != 0) {
                status = kk_fail(KK_ERR_INVALID_ARGUMENT,
                                 "kk_runtime_init: already running from '%s'; cannot switch to "
                                 "'%s' (one interpreter per process)", kk_python, chosen);
            }
        }
        goto done;
    case KK_STATE_FAILED:
        status = kk_fail(KK_ERR_RUNTIME, "kk_runtime_init: the runtime failed to start earlier: %s",
                         kk_failure);
        goto done;
    case KK_STATE_DOWN:
        status = kk_enter("kk_runtime_init");
        goto done;
    default:
        break;
    }

    /* Nothing has happened yet: a bad argument can be corrected by calling again. */
    if (!Py_IsInitialized()) {
        status = kk_choose_python(python_executable, chosen, sizeof chosen);
        if (status == KK_OK) {
            status = kk_check_python_version(chosen);
        }
    } else if (python_executable != NULL) {
        status = kk_fail(KK_ERR_INVALID_ARGUMENT,
                         "kk_runtime_init: a Python interpreter already runs in this process; "
                         "pass NULL to use it");
    }
    if (status == KK_OK) {
        status = kk_promote_libpython();
    }
    if (status != KK_OK) {
        goto done;
    }

    /* From here on a failure is final: an interpreter cannot be started twice. */
    if (!Py_IsInitialized()) {
        status = kk_start_interpreter(chosen);
        if (status == KK_OK) {
            kk_owns_interpreter = 1;
            kk_init_thread = pthread_self();
            snprintf(kk_python, sizeof kk_python, "%s", chosen);
        }
    }
    if (status == KK_OK) {
        status = kk_check_cffi_backend();
    }
    if (status == KK_OK && cffi_start_python() != 0) {
        status = kk_fail(KK_ERR_RUNTIME,
                         "kk_runtime_init: the embedded Python failed to run libkk's start-up "
                         "code (its traceback went to stderr)");
    }
    if (status == KK_OK) {
        status = (kk_status)_kk_py_init_check();
    }
    if (status == KK_OK) {
        static int registered;
        if (!registered) {
            registered = 1;
            atexit(kk_at_exit);
        }
        __atomic_store_n(&kk_state, KK_STATE_READY, __ATOMIC_RELEASE);
    } else {
        snprintf(kk_failure, sizeof kk_failure, "%s", kk_error_text);
        __atomic_store_n(&kk_state, KK_STATE_FAILED, __ATOMIC_RELEASE);
    }
done:
    pthread_mutex_unlock(&kk_init_lock);
    return status;
}

KK_API kk_status kk_runtime_info(kk_format format, char *buffer, size_t capacity,
                                 size_t *length) {
    static const char *const function = "kk_runtime_info";
    KK_ENTER(function);
    KK_CHECK(format == KK_FORMAT_JSON || format == KK_FORMAT_MSGPACK, function,
             "format is %d: expected KK_FORMAT_JSON or KK_FORMAT_MSGPACK", (int)format);
    KK_CHECK(buffer != NULL || capacity == 0, function, "buffer is NULL but capacity is %zu",
             capacity);
    KK_CHECK(length != NULL, function, "length is NULL");
    return (kk_status)_kk_py_runtime_info((int)format, buffer, capacity, length);
}

KK_API kk_status kk_runtime_shutdown(void) {
    kk_status status = kk_enter("kk_runtime_shutdown");
    if (status != KK_OK) {
        return status;
    }
    pthread_mutex_lock(&kk_init_lock);
    if (kk_state == KK_STATE_READY) {
        status = (kk_status)_kk_py_shutdown();
        __atomic_store_n(&kk_state, KK_STATE_DOWN, __ATOMIC_RELEASE);
        /* Finalizing belongs to the thread that started the interpreter (its main thread); from
           any other thread the sessions are freed and the streams flushed, and Python stays. */
        if (kk_owns_interpreter && pthread_equal(pthread_self(), kk_init_thread)) {
            PyGILState_Ensure();
            if (Py_FinalizeEx() < 0 && status == KK_OK) {
                status = kk_fail(KK_ERR_RUNTIME,
                                 "kk_runtime_shutdown: Python could not flush its output");
            }
        }
    } else {
        status = kk_enter("kk_runtime_shutdown");
    }
    pthread_mutex_unlock(&kk_init_lock);
    return status;
}
