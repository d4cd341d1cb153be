/*
 * The C half of libkk's C ABI: the exported kk_* functions.
 *
 * build.py hands this file to cffi as the C source of the "_libkk_c" embedding module, after a
 * few generated #defines (KK_BUILD_PYTHON, KK_VERSION_STRING, the sampling defaults). cffi puts
 * Python.h and its embedding support (cffi_start_python) before it, and defines after it the
 * extern "Python" functions (_kk_py_*) whose bodies live in _embedded.py (with _marshal.py).
 *
 * runtime.c (starting and stopping the interpreter) follows this file in the same unit.
 *
 * Every exported function checks what it can in C (runtime state, NULL pointers, lengths, enum
 * values) before any Python runs, so a bad call never needs the interpreter; the Python half
 * checks the rest (handles, request ids, UTF-8, JSON, settings) and maps libkk's exceptions to
 * status codes. Errors are kept per thread in a C buffer, so kk_last_error() works even when the
 * interpreter is not running.
 */
#include "libkk.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- the extern "Python" functions (defined by cffi below, implemented in _embedded.py) ---- */

static int _kk_py_init_check(void);
static int _kk_py_shutdown(void);
static void _kk_py_flush(void);
static int _kk_py_runtime_info(int format, char *buffer, size_t capacity, size_t *length);
static int _kk_py_session_create(const kk_session_params *params, uint64_t *out_handle);
static int _kk_py_session_free(uint64_t handle);
static int _kk_py_session_info(uint64_t handle, int format, char *buffer, size_t capacity,
                               size_t *length);
static int _kk_py_tokenize(uint64_t handle, const char *text, bool add_special_tokens,
                           int32_t *token_ids, size_t capacity, size_t *n_tokens);
static int _kk_py_detokenize(uint64_t handle, const int32_t *token_ids, size_t n_tokens,
                             bool skip_special_tokens, char *text, size_t capacity,
                             size_t *text_len);
static int _kk_py_generate(uint64_t handle, const kk_prompt *prompt,
                           const kk_request_params *params, kk_output *out);
static int _kk_py_submit(uint64_t handle, const kk_prompt *prompt,
                         const kk_request_params *params, uint64_t *out_id);
static int _kk_py_step(uint64_t handle, size_t *num_unfinished);
static int _kk_py_poll(uint64_t handle, uint64_t request_id, kk_output *out);
static int _kk_py_abort(uint64_t handle, uint64_t request_id);

/* ---- per-thread error message ---------------------------------------------------------------- */

#define KK_ERROR_CAPACITY 4096

static __thread char kk_error_text[KK_ERROR_CAPACITY];

/* Copies message, cut at a UTF-8 character boundary if it does not fit. Called from Python too. */
static void _kk_set_error(const char *message) {
    size_t n = message ? strlen(message) : 0;
    if (n >= KK_ERROR_CAPACITY) {
        n = KK_ERROR_CAPACITY - 1;
        while (n > 0 && ((unsigned char)message[n] & 0xC0) == 0x80) {
            n--; /* message[n] would continue a character: cut before its first byte */
        }
    }
    if (n) {
        memcpy(kk_error_text, message, n);
    }
    kk_error_text[n] = '\0';
}

static kk_status kk_fail(kk_status status, const char *format, ...) {
    char message[KK_ERROR_CAPACITY];
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    _kk_set_error(message);
    return status;
}

/* ---- runtime state --------------------------------------------------------------------------- */

enum { KK_STATE_NONE = 0, KK_STATE_READY = 1, KK_STATE_FAILED = 2, KK_STATE_DOWN = 3 };

static int kk_state = KK_STATE_NONE; /* read with __atomic_load_n: entries check it lock-free */
static char kk_failure[KK_ERROR_CAPACITY]; /* why the start failed (KK_STATE_FAILED) */

static kk_status kk_enter(const char *function) {
    kk_error_text[0] = '\0';
    switch (__atomic_load_n(&kk_state, __ATOMIC_ACQUIRE)) {
    case KK_STATE_READY:
        return KK_OK;
    case KK_STATE_DOWN:
        return kk_fail(KK_ERR_NOT_INITIALIZED,
                       "%s: the runtime was shut down (kk_runtime_shutdown); it cannot be "
                       "restarted in the same process", function);
    case KK_STATE_FAILED:
        return kk_fail(KK_ERR_NOT_INITIALIZED, "%s: the runtime failed to start: %s", function,
                       kk_failure);
    default:
        return kk_fail(KK_ERR_NOT_INITIALIZED,
                       "%s: the runtime is not initialized; call kk_runtime_init first", function);
    }
}

#define KK_ENTER(function)                                                                        \
    do {                                                                                          \
        kk_status entered_ = kk_enter(function);                                                  \
        if (entered_ != KK_OK) {                                                                  \
            return entered_;                                                                      \
        }                                                                                         \
    } while (0)

#define KK_CHECK(condition, function, ...)                                                        \
    do {                                                                                          \
        if (!(condition)) {                                                                       \
            char where_[KK_ERROR_CAPACITY];                                                       \
            snprintf(where_, sizeof where_, __VA_ARGS__);                                         \
            return kk_fail(KK_ERR_INVALID_ARGUMENT, "%s: %s", function, where_);                  \
        }                                                                                         \
    } while (0)

#define KK_CHECK_SESSION(session, function)                                                       \
    do {                                                                                          \
        if ((session) == NULL) {                                                                  \
            return kk_fail(KK_ERR_INVALID_HANDLE, "%s: session is NULL", function);               \
        }                                                                                         \
    } while (0)

static uint64_t kk_handle(const kk_session *session) {
    return (uint64_t)(uintptr_t)session;
}

/* ---- version, status names, errors ----------------------------------------------------------- */

KK_API const char *kk_version(void) {
    return KK_VERSION_STRING;
}

KK_API uint32_t kk_abi_version(void) {
    return KK_ABI_VERSION;
}

KK_API const char *kk_status_string(kk_status status) {
    switch (status) {
    case KK_OK: return "KK_OK";
    case KK_ERR_INVALID_ARGUMENT: return "KK_ERR_INVALID_ARGUMENT";
    case KK_ERR_MODEL_NOT_FOUND: return "KK_ERR_MODEL_NOT_FOUND";
    case KK_ERR_MODEL_LOAD: return "KK_ERR_MODEL_LOAD";
    case KK_ERR_CONFIG: return "KK_ERR_CONFIG";
    case KK_ERR_SAMPLING_PARAMS: return "KK_ERR_SAMPLING_PARAMS";
    case KK_ERR_INVALID_REQUEST: return "KK_ERR_INVALID_REQUEST";
    case KK_ERR_PROMPT_TOO_LONG: return "KK_ERR_PROMPT_TOO_LONG";
    case KK_ERR_UNKNOWN_REQUEST: return "KK_ERR_UNKNOWN_REQUEST";
    case KK_ERR_BUFFER_TOO_SMALL: return "KK_ERR_BUFFER_TOO_SMALL";
    case KK_ERR_INVALID_HANDLE: return "KK_ERR_INVALID_HANDLE";
    case KK_ERR_NOT_INITIALIZED: return "KK_ERR_NOT_INITIALIZED";
    case KK_ERR_RUNTIME: return "KK_ERR_RUNTIME";
    case KK_ERR_MISSING_DEPENDENCY: return "KK_ERR_MISSING_DEPENDENCY";
    case KK_ERR_REQUEST_FAILED: return "KK_ERR_REQUEST_FAILED";
    case KK_ERR_INTERNAL: return "KK_ERR_INTERNAL";
    }
    return "KK_STATUS_UNKNOWN";
}

KK_API const char *kk_last_error(void) {
    return kk_error_text;
}

/* ---- sessions -------------------------------------------------------------------------------- */

KK_API kk_session_params kk_session_default_params(void) {
    kk_session_params params;
    memset(&params, 0, sizeof params);
    return params;
}

KK_API kk_status kk_session_create(const kk_session_params *params, kk_session **out_session) {
    static const char *const function = "kk_session_create";
    if (out_session != NULL) {
        *out_session = NULL;
    }
    KK_ENTER(function);
    KK_CHECK(out_session != NULL, function, "out_session is NULL");
    kk_session_params defaults = kk_session_default_params();
    uint64_t handle = 0;
    kk_status status =
        (kk_status)_kk_py_session_create(params != NULL ? params : &defaults, &handle);
    if (status == KK_OK) {
        *out_session = (kk_session *)(uintptr_t)handle;
    }
    return status;
}

KK_API kk_status kk_session_free(kk_session *session) {
    static const char *const function = "kk_session_free";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    return (kk_status)_kk_py_session_free(kk_handle(session));
}

KK_API kk_status kk_session_info(kk_session *session, kk_format format, char *buffer,
                                 size_t capacity, size_t *length) {
    static const char *const function = "kk_session_info";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    KK_CHECK(format == KK_FORMAT_JSON || format == KK_FORMAT_MSGPACK, function,
             "format is %d: expected KK_FORMAT_JSON or KK_FORMAT_MSGPACK", (int)format);
    KK_CHECK(buffer != NULL || capacity == 0, function, "buffer is NULL but capacity is %zu",
             capacity);
    KK_CHECK(length != NULL, function, "length is NULL");
    return (kk_status)_kk_py_session_info(kk_handle(session), (int)format, buffer, capacity,
                                          length);
}

KK_API kk_status kk_tokenize(kk_session *session, const char *text, bool add_special_tokens,
                             int32_t *token_ids, size_t capacity, size_t *n_tokens) {
    static const char *const function = "kk_tokenize";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    KK_CHECK(text != NULL, function, "text is NULL");
    KK_CHECK(token_ids != NULL || capacity == 0, function,
             "token_ids is NULL but capacity is %zu", capacity);
    KK_CHECK(n_tokens != NULL, function, "n_tokens is NULL");
    return (kk_status)_kk_py_tokenize(kk_handle(session), text, add_special_tokens, token_ids,
                                      capacity, n_tokens);
}

KK_API kk_status kk_detokenize(kk_session *session, const int32_t *token_ids, size_t n_tokens,
                               bool skip_special_tokens, char *text, size_t capacity,
                               size_t *text_len) {
    static const char *const function = "kk_detokenize";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    KK_CHECK(token_ids != NULL || n_tokens == 0, function,
             "token_ids is NULL but n_tokens is %zu", n_tokens);
    KK_CHECK(text != NULL || capacity == 0, function, "text is NULL but capacity is %zu",
             capacity);
    KK_CHECK(text_len != NULL, function, "text_len is NULL");
    return (kk_status)_kk_py_detokenize(kk_handle(session), token_ids, n_tokens,
                                        skip_special_tokens, text, capacity, text_len);
}

/* ---- requests -------------------------------------------------------------------------------- */

KK_API kk_request_params kk_request_default_params(void) {
    kk_request_params params;
    memset(&params, 0, sizeof params);
    params.max_tokens = KK_DEFAULT_MAX_TOKENS;
    params.temperature = KK_DEFAULT_TEMPERATURE;
    params.top_k = KK_DEFAULT_TOP_K;
    params.top_p = KK_DEFAULT_TOP_P;
    params.min_p = KK_DEFAULT_MIN_P;
    params.repetition_penalty = KK_DEFAULT_REPETITION_PENALTY;
    params.seed = KK_SEED_NONE;
    params.ignore_eos = KK_DEFAULT_IGNORE_EOS;
    return params;
}

static kk_status kk_check_prompt(const char *function, const kk_prompt *prompt) {
    KK_CHECK(prompt != NULL, function, "prompt is NULL");
    int kinds = (prompt->text != NULL) + (prompt->token_ids != NULL) +
                (prompt->messages_json != NULL);
    KK_CHECK(kinds == 1, function,
             "prompt sets %d of text, token_ids and messages_json: expected exactly one", kinds);
    KK_CHECK(prompt->token_ids != NULL || prompt->n_tokens == 0, function,
             "prompt->n_tokens is %zu but prompt->token_ids is NULL", prompt->n_tokens);
    return KK_OK;
}

static kk_status kk_check_output(const char *function, kk_output *out) {
    KK_CHECK(out != NULL, function, "out is NULL");
    KK_CHECK(out->text != NULL || out->text_capacity == 0, function,
             "out->text is NULL but out->text_capacity is %zu", out->text_capacity);
    KK_CHECK(out->token_ids != NULL || out->token_capacity == 0, function,
             "out->token_ids is NULL but out->token_capacity is %zu", out->token_capacity);
    KK_CHECK(out->encoded != NULL || out->encoded_capacity == 0, function,
             "out->encoded is NULL but out->encoded_capacity is %zu", out->encoded_capacity);
    KK_CHECK(out->encoded_format == KK_FORMAT_JSON || out->encoded_format == KK_FORMAT_MSGPACK,
             function, "out->encoded_format is %d: expected KK_FORMAT_JSON or KK_FORMAT_MSGPACK",
             (int)out->encoded_format);
    out->text_len = 0;
    out->n_tokens = 0;
    out->encoded_len = 0;
    out->finished = false;
    out->finish_reason = KK_FINISH_NONE;
    out->request_id = 0;
    return KK_OK;
}

KK_API kk_status kk_generate(kk_session *session, const kk_prompt *prompt,
                             const kk_request_params *params, kk_output *out) {
    static const char *const function = "kk_generate";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    kk_status status = kk_check_prompt(function, prompt);
    if (status == KK_OK) {
        status = kk_check_output(function, out);
    }
    if (status != KK_OK) {
        return status;
    }
    return (kk_status)_kk_py_generate(kk_handle(session), prompt, params, out);
}

KK_API kk_status kk_submit(kk_session *session, const kk_prompt *prompt,
                           const kk_request_params *params, kk_request_id *out_id) {
    static const char *const function = "kk_submit";
    if (out_id != NULL) {
        *out_id = 0;
    }
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    kk_status status = kk_check_prompt(function, prompt);
    if (status != KK_OK) {
        return status;
    }
    KK_CHECK(out_id != NULL, function, "out_id is NULL");
    KK_CHECK(params == NULL || params->on_token == NULL, function,
             "params->on_token is set: a submitted request delivers its output through kk_poll "
             "(on_token is for kk_generate)");
    uint64_t id = 0;
    status = (kk_status)_kk_py_submit(kk_handle(session), prompt, params, &id);
    if (status == KK_OK) {
        *out_id = id;
    }
    return status;
}

KK_API kk_status kk_step(kk_session *session, size_t *num_unfinished) {
    static const char *const function = "kk_step";
    if (num_unfinished != NULL) {
        *num_unfinished = 0;
    }
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    return (kk_status)_kk_py_step(kk_handle(session), num_unfinished);
}

KK_API kk_status kk_poll(kk_session *session, kk_request_id request_id, kk_output *out) {
    static const char *const function = "kk_poll";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    kk_status status = kk_check_output(function, out);
    if (status != KK_OK) {
        return status;
    }
    return (kk_status)_kk_py_poll(kk_handle(session), request_id, out);
}

KK_API kk_status kk_abort(kk_session *session, kk_request_id request_id) {
    static const char *const function = "kk_abort";
    KK_ENTER(function);
    KK_CHECK_SESSION(session, function);
    return (kk_status)_kk_py_abort(kk_handle(session), request_id);
}
