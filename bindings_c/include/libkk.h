/*
 * libkk.h - the C interface of libkk, an embeddable in-process LLM inference runtime.
 *
 * A host links libkk.so (or dlopens it, RTLD_LOCAL is fine) and drives libkk in its own process.
 * libkk itself runs in an embedded Python interpreter; the host never writes Python.
 *
 *   kk_runtime_init(NULL);                          start the interpreter (once per process)
 *   kk_session *s;
 *   kk_session_params sp = kk_session_default_params();
 *   kk_session_create(&sp, &s);                     load a model (NULL path: the default model)
 *   kk_request_params rp = kk_request_default_params();
 *   char text[4096];
 *   kk_output out = {0};
 *   out.text = text; out.text_capacity = sizeof text;
 *   kk_prompt prompt = kk_prompt_from_text("The capital of France is");
 *   kk_generate(s, &prompt, &rp, &out);             blocking; or kk_submit / kk_step / kk_poll
 *   kk_session_free(s);
 *   kk_runtime_shutdown();
 *
 * Conventions
 * - Every function returns a kk_status (KK_OK is 0). On failure kk_last_error() holds a message
 *   that names the argument or setting at fault; it is per thread, so threads do not see each
 *   other's errors.
 * - Nothing the host passes is trusted: NULL pointers, lengths, handles (stale, freed or made up),
 *   request ids, UTF-8 and JSON are all checked and reported as a status, never a crash.
 * - Text crosses as UTF-8, token ids as int32_t arrays, structured results as JSON or msgpack.
 * - Results go into caller buffers. When a buffer is too small the call returns
 *   KK_ERR_BUFFER_TOO_SMALL, reports the size it needs and consumes nothing, so the call can be
 *   repeated with a larger buffer (a capacity of 0 is a size query; in a kk_output a NULL
 *   buffer means "not wanted" instead).
 * - Every function may be called from several threads at once, on one session or on several.
 *   Threads generating on one session share its batches.
 */
#ifndef LIBKK_H
#define LIBKK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  if defined(KK_BUILD)
#    define KK_API __declspec(dllexport)
#  else
#    define KK_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__)
#  define KK_API __attribute__((visibility("default")))
#else
#  define KK_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a struct layout or a function signature of this header changes. */
#define KK_ABI_VERSION 2

/* kk_request_params.seed: no seed, each request draws a fresh one. */
#define KK_SEED_NONE INT64_MIN
/* kk_request_params.max_tokens: no limit but the model's context length. */
#define KK_MAX_TOKENS_NONE (-1)

typedef enum kk_status {
    KK_OK = 0,
    KK_ERR_INVALID_ARGUMENT = 1,   /* a NULL pointer, a bad length or enum value, invalid UTF-8 */
    KK_ERR_MODEL_NOT_FOUND = 2,    /* the model path does not exist or lacks a required file */
    KK_ERR_MODEL_LOAD = 3,         /* the checkpoint is corrupt, unreadable or unsupported */
    KK_ERR_CONFIG = 4,             /* settings_json is not JSON, or names a bad setting or value */
    KK_ERR_SAMPLING_PARAMS = 5,    /* a sampling parameter (or sampling_json) is out of range */
    KK_ERR_INVALID_REQUEST = 6,    /* the prompt cannot be served (empty, bad token ids, ...) */
    KK_ERR_PROMPT_TOO_LONG = 7,    /* the prompt does not fit in the model's context */
    KK_ERR_UNKNOWN_REQUEST = 8,    /* the session does not know this request id */
    KK_ERR_BUFFER_TOO_SMALL = 9,   /* a caller buffer is too small; the needed size is reported */
    KK_ERR_INVALID_HANDLE = 10,    /* a NULL, freed or unknown session handle */
    KK_ERR_NOT_INITIALIZED = 11,   /* kk_runtime_init has not succeeded, or the runtime shut down */
    KK_ERR_RUNTIME = 12,           /* the embedded Python or libkk could not be started */
    KK_ERR_MISSING_DEPENDENCY = 13,/* a Python package is missing; the message says which one */
    KK_ERR_REQUEST_FAILED = 14,    /* the request ended in an error; its output is delivered */
    KK_ERR_INTERNAL = 15           /* a bug in libkk; the message carries the Python exception */
} kk_status;

/* How a request ended (kk_output.finish_reason). */
typedef enum kk_finish_reason {
    KK_FINISH_NONE = 0,            /* not finished yet */
    KK_FINISH_STOP = 1,            /* an end-of-sequence token, a stop token or a stop string */
    KK_FINISH_LENGTH = 2,          /* max_tokens or the model's context length */
    KK_FINISH_ABORT = 3,           /* kk_abort, a callback, or the session was freed */
    KK_FINISH_ERROR = 4            /* the request failed; see KK_ERR_REQUEST_FAILED */
} kk_finish_reason;

/* Encoding of structured results. */
typedef enum kk_format {
    KK_FORMAT_JSON = 0,            /* UTF-8 JSON, NUL-terminated */
    KK_FORMAT_MSGPACK = 1          /* msgpack bytes, not terminated */
} kk_format;

/* An opaque session: one loaded model serving requests. */
typedef struct kk_session kk_session;

/* Identifies a request within its session; never 0 for a real request. */
typedef uint64_t kk_request_id;

/*
 * Called by kk_generate with each new piece of output: text_utf8 (len bytes, NUL-terminated,
 * never a split UTF-8 character) and the token ids generated since the previous call. Either may
 * be empty. Return false to stop the request (it finishes with KK_FINISH_ABORT). The pointers are
 * valid only during the call. Runs on the thread that called kk_generate; must not throw.
 */
typedef bool (*kk_token_callback)(const char *text_utf8, size_t len, const int32_t *token_ids,
                                  size_t n_tokens, void *user_data);

/*
 * Polled between engine steps (by kk_generate, and by kk_step for requests from kk_submit).
 * Return true to stop the request (it finishes with KK_FINISH_ABORT). Must not throw.
 */
typedef bool (*kk_abort_callback)(void *user_data);

/* What a session loads and how it is set up. Start from kk_session_default_params(). */
typedef struct kk_session_params {
    /* An HF-layout model folder or a .gguf file; NULL: the default model (SmolLM2-135M). */
    const char *model_path;
    /* Engine settings as a JSON object, flat ({"max_num_seqs": 8}) or by section
       ({"scheduler": {"max_num_seqs": 8}, "cache": {"block_size": 32}}); NULL: the defaults.
       {"num_threads": N} sets the CPU threads libkk computes with (torch's, process-wide, set
       when the session is created; default: the physical cores the process may run on). On a
       host that runs its own threads beside libkk's, fewer threads are often faster. */
    const char *settings_json;
} kk_session_params;

/* How one request is decoded. Start from kk_request_default_params(). */
typedef struct kk_request_params {
    int32_t max_tokens;            /* tokens to generate at most (>= 1), or KK_MAX_TOKENS_NONE */
    double temperature;            /* 0: greedy */
    int32_t top_k;                 /* 0 or -1: off */
    double top_p;                  /* 1: off */
    double min_p;                  /* 0: off */
    double repetition_penalty;     /* 1: off */
    int64_t seed;                  /* same seed, same tokens (alone or batched); or KK_SEED_NONE */
    bool ignore_eos;               /* keep going past end-of-sequence tokens */
    /* Further sampling parameters as a JSON object, applied over the fields above: "stop",
       "stop_token_ids", "min_tokens", "presence_penalty", "frequency_penalty", "logprobs",
       "include_stop_str_in_output", "skip_special_tokens", ...; NULL: none. */
    const char *sampling_json;
    /* Structured output as a JSON object, one of {"json_schema": {...}}, {"json": true},
       {"regex": "..."}, {"choice": ["yes", "no"]}, {"grammar": "<lark>"}: the output always
       matches it. Not such an object: KK_ERR_SAMPLING_PARAMS; a malformed schema, regex or
       grammar: KK_ERR_INVALID_REQUEST (both before anything runs). NULL: unconstrained. */
    const char *structured_json;
    /* kk_generate only (kk_submit rejects it): receives the output piece by piece. */
    kk_token_callback on_token;
    void *on_token_data;
    /* Polled between steps; returning true stops the request. */
    kk_abort_callback should_abort;
    void *should_abort_data;
} kk_request_params;

/* A prompt: exactly one of text, token_ids or messages_json is set (see kk_prompt_from_*). */
typedef struct kk_prompt {
    const char *text;              /* UTF-8, NUL-terminated */
    const int32_t *token_ids;      /* n_tokens token ids */
    size_t n_tokens;
    /* A chat as a JSON array of {"role": ..., "content": ...} objects, rendered with the model's
       chat template (with the generation prompt). */
    const char *messages_json;
} kk_prompt;

/*
 * Where a call puts a request's output. The caller sets the buffers; libkk fills the rest.
 * A NULL buffer (with capacity 0) means "not wanted": its length is still reported. A buffer
 * that is too small makes the call return KK_ERR_BUFFER_TOO_SMALL with the needed lengths set
 * and nothing consumed. Zero-initialize it: kk_output out = {0};
 */
typedef struct kk_output {
    char *text;                    /* UTF-8, NUL-terminated */
    size_t text_capacity;          /* bytes, the NUL included */
    int32_t *token_ids;
    size_t token_capacity;         /* token ids */
    char *encoded;                 /* the request's full output (text, token ids, finish and stop */
    size_t encoded_capacity;       /* reason, logprobs, timeline, ...) as JSON or msgpack */
    kk_format encoded_format;

    size_t text_len;               /* bytes of text (NUL excluded): written, or needed */
    size_t n_tokens;               /* token ids: written, or needed */
    size_t encoded_len;            /* bytes of the encoding (NUL excluded): written, or needed */
    bool finished;                 /* the request finished and everything has been delivered */
    kk_finish_reason finish_reason;
    kk_request_id request_id;
} kk_output;

/* ---------------------------------------------------------------------------------------------
 * Runtime
 */

/* The libkk version this library was built from, e.g. "0.1.0". Needs no initialization. */
KK_API const char *kk_version(void);

/* KK_ABI_VERSION of the built library; compare it with the header's to catch a mismatch. */
KK_API uint32_t kk_abi_version(void);

/* A short constant name of a status, e.g. "KK_ERR_CONFIG". Needs no initialization. */
KK_API const char *kk_status_string(kk_status status);

/*
 * The message of the last call on this thread that failed ("" after a call that succeeded).
 * Valid until the next libkk call on this thread. Never NULL.
 */
KK_API const char *kk_last_error(void);

/*
 * Starts the embedded Python interpreter and imports libkk. Call it once, before anything else
 * (further calls return KK_OK if they ask for the same Python, KK_ERR_INVALID_ARGUMENT if not).
 *
 * python_executable picks the Python environment, exactly as running that executable would:
 * a virtualenv's bin/python uses the virtualenv (its pyvenv.cfg and site-packages). It must be
 * the Python version this library was built for. NULL: $LIBKK_PYTHON if set, else the Python
 * that built the library. The interpreter runs in UTF-8 mode whatever the locale (the C locale
 * included) and leaves the process locale and signal handlers alone. It may take seconds
 * (importing torch). A bad python_executable is reported before anything starts, so the call can
 * be repeated; KK_ERR_RUNTIME (with a message) when the interpreter or libkk cannot start is
 * final. In a host that already runs Python, libkk uses that interpreter (pass NULL).
 */
KK_API kk_status kk_runtime_init(const char *python_executable);

/*
 * The running interpreter as a JSON or msgpack object: libkk_version, python_version,
 * executable, prefix, base_prefix, utf8_mode, sessions (live ones), torch_num_threads (the CPU
 * threads libkk computes with now; see num_threads in kk_session_params). Size query with
 * capacity 0.
 */
KK_API kk_status kk_runtime_info(kk_format format, char *buffer, size_t capacity, size_t *length);

/*
 * Frees every session, flushes Python's output streams and finalizes the interpreter. Call it
 * once, after every other thread is done with libkk, from the thread that called
 * kk_runtime_init (from another thread the interpreter is left running, idle). Afterwards every
 * call returns KK_ERR_NOT_INITIALIZED: the runtime cannot be restarted in the same process.
 * Without it, Python's output streams are still flushed at process exit.
 */
KK_API kk_status kk_runtime_shutdown(void);

/* ---------------------------------------------------------------------------------------------
 * Sessions
 */

/* model_path NULL (the default model), settings_json NULL (the default settings). */
KK_API kk_session_params kk_session_default_params(void);

/*
 * Loads a model and returns a session in *out_session (set to NULL on failure).
 * KK_ERR_MODEL_NOT_FOUND, KK_ERR_MODEL_LOAD, KK_ERR_CONFIG (bad settings_json), ...
 * params may be NULL (the defaults).
 */
KK_API kk_status kk_session_create(const kk_session_params *params, kk_session **out_session);

/*
 * Stops the session's requests and frees its model and cache. Calls still running on the session
 * in other threads return (KK_ERR_INVALID_HANDLE); the handle is invalid afterwards.
 */
KK_API kk_status kk_session_free(kk_session *session);

/* The session's resolved settings and model facts (config, max_model_len, vocab_size) encoded. */
KK_API kk_status kk_session_info(kk_session *session, kk_format format, char *buffer,
                                 size_t capacity, size_t *length);

/*
 * Token ids of text (UTF-8, NUL-terminated) into token_ids[0..capacity); *n_tokens receives the
 * count (written, or needed on KK_ERR_BUFFER_TOO_SMALL).
 */
KK_API kk_status kk_tokenize(kk_session *session, const char *text, bool add_special_tokens,
                             int32_t *token_ids, size_t capacity, size_t *n_tokens);

/* Text of n_tokens token ids into text[0..capacity), NUL-terminated; *text_len as kk_tokenize. */
KK_API kk_status kk_detokenize(kk_session *session, const int32_t *token_ids, size_t n_tokens,
                               bool skip_special_tokens, char *text, size_t capacity,
                               size_t *text_len);

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

/* The defaults of libkk's SamplingParams, no callbacks. */
KK_API kk_request_params kk_request_default_params(void);

/*
 * Generates for one prompt and blocks until the request finishes. out receives the whole text,
 * the token ids and (if asked) the encoded output. With params->on_token the output also streams
 * through the callback; with params->should_abort the request can be stopped. params may be NULL
 * (the defaults).
 *
 * If out's buffers are too small, returns KK_ERR_BUFFER_TOO_SMALL with the needed lengths and
 * keeps the finished output under out->request_id: take it with kk_poll (larger buffers) or drop
 * it with kk_abort. Returns KK_ERR_REQUEST_FAILED (output delivered) if the request failed.
 */
KK_API kk_status kk_generate(kk_session *session, const kk_prompt *prompt,
                             const kk_request_params *params, kk_output *out);

/*
 * Queues a request without running it; its id goes to *out_id. Drive it with kk_step and take its
 * output with kk_poll. params may be NULL (the defaults); on_token must be NULL.
 */
KK_API kk_status kk_submit(kk_session *session, const kk_prompt *prompt,
                           const kk_request_params *params, kk_request_id *out_id);

/*
 * Runs one engine step for everything the session holds (first polling the should_abort
 * callbacks of submitted requests). *num_unfinished (may be NULL) receives how many requests
 * from kk_submit the engine has not finished yet.
 */
KK_API kk_status kk_step(kk_session *session, size_t *num_unfinished);

/*
 * Takes what a request produced since the last kk_poll: out->text and out->token_ids get the new
 * text and token ids (out->encoded, if set, the full output so far). When the request has finished
 * and this call delivered its end, out->finished is true and the id is released (later calls:
 * KK_ERR_UNKNOWN_REQUEST). KK_ERR_REQUEST_FAILED (output delivered) when that end is an error.
 */
KK_API kk_status kk_poll(kk_session *session, kk_request_id request_id, kk_output *out);

/*
 * Stops a request from kk_submit; kk_step then delivers its end (KK_FINISH_ABORT) to kk_poll.
 * A finished request is left as it is; an output kept by kk_generate is dropped.
 */
KK_API kk_status kk_abort(kk_session *session, kk_request_id request_id);

/* ---------------------------------------------------------------------------------------------
 * Helpers
 */

static inline kk_prompt kk_prompt_from_text(const char *text) {
    kk_prompt prompt;
    prompt.text = text;
    prompt.token_ids = NULL;
    prompt.n_tokens = 0;
    prompt.messages_json = NULL;
    return prompt;
}

static inline kk_prompt kk_prompt_from_tokens(const int32_t *token_ids, size_t n_tokens) {
    kk_prompt prompt = kk_prompt_from_text(NULL);
    prompt.token_ids = token_ids;
    prompt.n_tokens = n_tokens;
    return prompt;
}

static inline kk_prompt kk_prompt_from_chat(const char *messages_json) {
    kk_prompt prompt = kk_prompt_from_text(NULL);
    prompt.messages_json = messages_json;
    return prompt;
}

#ifdef __cplusplus
}
#endif

#endif /* LIBKK_H */
