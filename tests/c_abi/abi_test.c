/* abi_test.c: the C ABI from a C host: every error path returns its status and a message,
 * results match across kk_generate / streaming / kk_submit+kk_step+kk_poll, four host threads
 * generate at once on one session, and the runtime shuts down cleanly.
 *
 *   abi_test MODEL_DIR
 *
 * Prints "ok <section>" per section and "ALL OK" at the end; every failed check prints a
 * "FAIL" line and makes the exit status 1.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "libkk.h"

static int failures;

#define CHECK(condition, ...)                                                                     \
    do {                                                                                          \
        if (!(condition)) {                                                                       \
            printf("FAIL line %d: %s: ", __LINE__, #condition);                                   \
            printf(__VA_ARGS__);                                                                  \
            printf(" [kk_last_error: %s]\n", kk_last_error());                                    \
            __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);                                   \
        }                                                                                         \
    } while (0)

/* The call returns `expected`; a failure leaves a message containing `needle`, a success none. */
#define EXPECT(call, expected, needle) expect_status((call), (expected), (needle), #call, __LINE__)

static void expect_status(kk_status got, kk_status expected, const char *needle, const char *call,
                          int line) {
    const char *message = kk_last_error();
    int bad = 0;
    if (got != expected) {
        printf("FAIL line %d: %s returned %s, expected %s", line, call, kk_status_string(got),
               kk_status_string(expected));
        bad = 1;
    } else if (expected != KK_OK && message[0] == '\0') {
        printf("FAIL line %d: %s returned %s without a message", line, call,
               kk_status_string(got));
        bad = 1;
    } else if (expected != KK_OK && needle != NULL && strstr(message, needle) == NULL) {
        printf("FAIL line %d: %s: the message lacks \"%s\"", line, call, needle);
        bad = 1;
    } else if (expected == KK_OK && message[0] != '\0') {
        printf("FAIL line %d: %s succeeded but left a message", line, call);
        bad = 1;
    }
    if (bad) {
        printf(" [kk_last_error: %s]\n", message);
        __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
    }
}

enum { TEXT_CAP = 4096, IDS_CAP = 512 };

typedef struct result {
    char text[TEXT_CAP];
    int32_t ids[IDS_CAP];
    size_t n_ids;
    kk_finish_reason finish;
} result;

static kk_output output_into(result *r) {
    kk_output out = {0};
    out.text = r->text;
    out.text_capacity = sizeof r->text;
    out.token_ids = r->ids;
    out.token_capacity = IDS_CAP;
    return out;
}

static kk_request_params greedy(int max_tokens) {
    kk_request_params params = kk_request_default_params();
    params.max_tokens = max_tokens;
    params.temperature = 0.0;
    params.ignore_eos = true;
    return params;
}

static kk_status generate(kk_session *s, const char *text, const kk_request_params *p, result *r) {
    kk_prompt prompt = kk_prompt_from_text(text);
    kk_output out = output_into(r);
    kk_status status = kk_generate(s, &prompt, p, &out);
    r->n_ids = out.n_tokens;
    r->finish = out.finish_reason;
    return status;
}

static int same(const result *a, const result *b) {
    return strcmp(a->text, b->text) == 0 && a->n_ids == b->n_ids &&
           memcmp(a->ids, b->ids, a->n_ids * sizeof(int32_t)) == 0;
}

static int os_threads(void) {
    FILE *file = fopen("/proc/self/status", "r");
    char line[256];
    int threads = -1;
    while (file != NULL && fgets(line, sizeof line, file) != NULL) {
        if (sscanf(line, "Threads: %d", &threads) == 1) break;
    }
    if (file != NULL) fclose(file);
    return threads;
}

/* ---- before kk_runtime_init, and starting it ----------------------------------------------- */

static void test_before_init(void) {
    CHECK(kk_version() != NULL && kk_version()[0] != '\0', "kk_version is empty");
    CHECK(kk_abi_version() == KK_ABI_VERSION, "ABI %u, header %d", kk_abi_version(),
          KK_ABI_VERSION);
    CHECK(strcmp(kk_status_string(KK_ERR_CONFIG), "KK_ERR_CONFIG") == 0, "status name");
    CHECK(strcmp(kk_status_string((kk_status)999), "KK_STATUS_UNKNOWN") == 0, "unknown name");
    CHECK(kk_last_error() != NULL, "kk_last_error is NULL");
    kk_session *s = (kk_session *)1;
    EXPECT(kk_session_create(NULL, &s), KK_ERR_NOT_INITIALIZED, "kk_runtime_init");
    CHECK(s == NULL, "out_session not cleared");
    size_t length;
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, NULL, 0, &length), KK_ERR_NOT_INITIALIZED, NULL);
    EXPECT(kk_runtime_shutdown(), KK_ERR_NOT_INITIALIZED, NULL);
    /* A bad executable fails before anything starts, so a good one can follow. */
    EXPECT(kk_runtime_init("/nonexistent/bin/python"), KK_ERR_INVALID_ARGUMENT,
           "/nonexistent/bin/python");
    EXPECT(kk_runtime_init(""), KK_ERR_INVALID_ARGUMENT, "empty");
    char plain[] = "/tmp/kk-abi-test-XXXXXX"; /* a file without execute permission */
    int fd = mkstemp(plain);
    CHECK(fd >= 0, "mkstemp");
    EXPECT(kk_runtime_init(plain), KK_ERR_INVALID_ARGUMENT, "not an executable");
    close(fd);
    unlink(plain);
    printf("ok before_init\n");
}

static void test_init(void) {
    EXPECT(kk_runtime_init(NULL), KK_OK, NULL);
    EXPECT(kk_runtime_init(NULL), KK_OK, NULL); /* once started, a no-op */
    EXPECT(kk_runtime_init("/usr/bin/env"), KK_ERR_INVALID_ARGUMENT, "already running");
    char info[2048];
    size_t length = 0;
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, NULL, 0, &length), KK_ERR_BUFFER_TOO_SMALL, "needs");
    CHECK(length > 10, "size query gave %zu", length);
    size_t needed = length;
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, info, needed, &length), KK_ERR_BUFFER_TOO_SMALL, NULL);
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, info, needed + 1, &length), KK_OK, NULL);
    CHECK(length == needed && strlen(info) == needed, "length %zu", length);
    CHECK(strstr(info, "\"utf8_mode\":1") != NULL, "not in UTF-8 mode: %s", info);
    EXPECT(kk_runtime_info((kk_format)7, info, sizeof info, &length), KK_ERR_INVALID_ARGUMENT,
           "format");
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, NULL, 10, &length), KK_ERR_INVALID_ARGUMENT, "NULL");
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, info, sizeof info, NULL), KK_ERR_INVALID_ARGUMENT,
           "length");
    EXPECT(kk_runtime_info(KK_FORMAT_MSGPACK, info, sizeof info, &length), KK_OK, NULL);
    CHECK(((unsigned char)info[0] & 0xF0) == 0x80, "not a msgpack map: %02x", info[0]);
    printf("ok init\n");
}

/* ---- sessions and handles ------------------------------------------------------------------- */

static const char *const SETTINGS = "{\"max_model_len\": 256, \"num_gpu_blocks\": 160, "
                                    "\"max_num_seqs\": 8, \"progress\": false, \"num_threads\": 1}";

static kk_session *open_session(const char *model, const char *settings, kk_status expected,
                                const char *needle) {
    kk_session_params params = kk_session_default_params();
    params.model_path = model;
    params.settings_json = settings;
    kk_session *s = (kk_session *)1;
    EXPECT(kk_session_create(&params, &s), expected, needle);
    CHECK((s == NULL) == (expected != KK_OK), "out_session %p", (void *)s);
    return s;
}

static kk_session *test_sessions(const char *model) {
    open_session("/no/such/model", NULL, KK_ERR_MODEL_NOT_FOUND, "/no/such/model");
    open_session(model, "{not json", KK_ERR_CONFIG, "JSON");
    open_session(model, "[1, 2]", KK_ERR_CONFIG, "object");
    open_session(model, "{\"max_num_seqs\": 0}", KK_ERR_CONFIG, "max_num_seqs");
    open_session(model, "{\"max_num_seqs\": \"many\"}", KK_ERR_CONFIG, "max_num_seqs");
    open_session(model, "{\"no_such_setting\": 1}", KK_ERR_CONFIG, "no_such_setting");
    open_session(model, "{\"num_threads\": 0}", KK_ERR_CONFIG, "$.num_threads");
    open_session(model, "{\"num_threads\": \"all\"}", KK_ERR_CONFIG, "$.num_threads");
    open_session("", NULL, KK_ERR_INVALID_ARGUMENT, "model_path");
    EXPECT(kk_session_create(NULL, NULL), KK_ERR_INVALID_ARGUMENT, "out_session");

    kk_session *s = open_session(model, SETTINGS, KK_OK, NULL);
    char info[4096];
    size_t length;
    EXPECT(kk_session_info(s, KK_FORMAT_JSON, info, sizeof info, &length), KK_OK, NULL);
    CHECK(strstr(info, "\"max_model_len\":256") != NULL, "session info: %s", info);
    CHECK(strstr(info, "\"num_threads\":1") != NULL, "session info: %s", info);
    /* num_threads took effect: the threads torch computes with */
    EXPECT(kk_runtime_info(KK_FORMAT_JSON, info, sizeof info, &length), KK_OK, NULL);
    CHECK(strstr(info, "\"torch_num_threads\":1") != NULL, "runtime info: %s", info);
    EXPECT(kk_session_info(s, KK_FORMAT_JSON, info, 3, &length), KK_ERR_BUFFER_TOO_SMALL, NULL);
    printf("ok sessions\n");
    return s;
}

static void test_handles(const char *model) {
    kk_prompt prompt = kk_prompt_from_text("hi");
    kk_output out = {0};
    kk_request_id id;
    size_t n;
    int32_t ids[4] = {1, 2, 3, 4};
    char text[16];
    kk_session *fake = (kk_session *)(uintptr_t)0xdeadbeef;
    kk_session *freed = open_session(model, SETTINGS, KK_OK, NULL);
    EXPECT(kk_session_free(freed), KK_OK, NULL);
    kk_session *bad[] = {NULL, fake, freed};
    const char *needles[] = {"NULL", "not a live session", "not a live session"};
    for (int i = 0; i < 3; i++) {
        kk_session *s = bad[i];
        EXPECT(kk_generate(s, &prompt, NULL, &out), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_submit(s, &prompt, NULL, &id), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_step(s, &n), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_poll(s, 1, &out), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_abort(s, 1), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_session_info(s, KK_FORMAT_JSON, text, sizeof text, &n), KK_ERR_INVALID_HANDLE,
               needles[i]);
        EXPECT(kk_tokenize(s, "hi", true, ids, 4, &n), KK_ERR_INVALID_HANDLE, needles[i]);
        EXPECT(kk_detokenize(s, ids, 4, true, text, sizeof text, &n), KK_ERR_INVALID_HANDLE,
               needles[i]);
        EXPECT(kk_session_free(s), KK_ERR_INVALID_HANDLE, needles[i]);
    }
    printf("ok handles\n");
}

/* ---- bad arguments -------------------------------------------------------------------------- */

static void test_arguments(kk_session *s) {
    result r;
    kk_output out = output_into(&r);
    kk_prompt text = kk_prompt_from_text("Hello");
    kk_request_params p = greedy(4);
    int32_t ids[3] = {1, 2, 3};

    EXPECT(kk_generate(s, NULL, &p, &out), KK_ERR_INVALID_ARGUMENT, "prompt is NULL");
    EXPECT(kk_generate(s, &text, &p, NULL), KK_ERR_INVALID_ARGUMENT, "out is NULL");
    kk_prompt two = kk_prompt_from_tokens(ids, 3);
    two.text = "Hello";
    EXPECT(kk_generate(s, &two, &p, &out), KK_ERR_INVALID_ARGUMENT, "exactly one");
    kk_prompt none = kk_prompt_from_text(NULL);
    EXPECT(kk_generate(s, &none, &p, &out), KK_ERR_INVALID_ARGUMENT, "exactly one");
    kk_prompt dangling = kk_prompt_from_chat("[]");
    dangling.n_tokens = 3;
    EXPECT(kk_generate(s, &dangling, &p, &out), KK_ERR_INVALID_ARGUMENT, "n_tokens");
    kk_output broken = out;
    broken.text = NULL;
    EXPECT(kk_generate(s, &text, &p, &broken), KK_ERR_INVALID_ARGUMENT, "out->text is NULL");
    broken = out;
    broken.token_ids = NULL;
    EXPECT(kk_generate(s, &text, &p, &broken), KK_ERR_INVALID_ARGUMENT, "out->token_ids");
    broken = out;
    broken.encoded_capacity = 8;
    EXPECT(kk_generate(s, &text, &p, &broken), KK_ERR_INVALID_ARGUMENT, "out->encoded");
    broken = out;
    broken.encoded_format = (kk_format)5;
    EXPECT(kk_generate(s, &text, &p, &broken), KK_ERR_INVALID_ARGUMENT, "encoded_format");

    /* Prompts libkk cannot serve. */
    kk_prompt empty = kk_prompt_from_text("");
    EXPECT(kk_generate(s, &empty, &p, &out), KK_ERR_INVALID_REQUEST, "empty");
    kk_prompt latin1 = kk_prompt_from_text("caf\xe9");
    EXPECT(kk_generate(s, &latin1, &p, &out), KK_ERR_INVALID_ARGUMENT, "UTF-8");
    int32_t out_of_range[2] = {5, 100000000};
    kk_prompt far = kk_prompt_from_tokens(out_of_range, 2);
    EXPECT(kk_generate(s, &far, &p, &out), KK_ERR_INVALID_REQUEST, "out of range");
    int32_t negative[1] = {-3};
    kk_prompt neg = kk_prompt_from_tokens(negative, 1);
    EXPECT(kk_generate(s, &neg, &p, &out), KK_ERR_INVALID_REQUEST, "out of range");
    kk_prompt no_tokens = kk_prompt_from_tokens(ids, 0);
    EXPECT(kk_generate(s, &no_tokens, &p, &out), KK_ERR_INVALID_REQUEST, "no tokens");
    kk_prompt huge = kk_prompt_from_tokens(ids, (size_t)1 << 40); /* never read: too long */
    EXPECT(kk_generate(s, &huge, &p, &out), KK_ERR_PROMPT_TOO_LONG, "max_model_len");
    static char long_text[8192];
    for (size_t i = 0; i + 6 < sizeof long_text; i += 6) memcpy(long_text + i, "words ", 6);
    kk_prompt too_long = kk_prompt_from_text(long_text);
    EXPECT(kk_generate(s, &too_long, &p, &out), KK_ERR_PROMPT_TOO_LONG, "max_model_len");
    kk_prompt bad_chat = kk_prompt_from_chat("[{\"role\": \"user\"");
    EXPECT(kk_generate(s, &bad_chat, &p, &out), KK_ERR_INVALID_REQUEST, "JSON");
    kk_prompt no_content = kk_prompt_from_chat("[{\"role\": \"user\"}]");
    EXPECT(kk_generate(s, &no_content, &p, &out), KK_ERR_INVALID_REQUEST, "content");

    /* Sampling parameters. */
    kk_request_params bad = greedy(4);
    bad.temperature = -1.0;
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "temperature");
    bad = greedy(0);
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "max_tokens");
    bad = greedy(4);
    bad.top_p = nan("");
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "top_p");
    bad = greedy(4);
    bad.sampling_json = "{\"stop\": [";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "JSON");
    bad.sampling_json = "{\"no_such_param\": 1}";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "no_such_param");
    bad.sampling_json = "{\"stop\": \"not a list\"}";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "stop");
    bad = greedy(4);
    bad.structured_json = "[1, 2]";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "structured_json");
    bad.structured_json = "{\"regex\": \"(unclosed\"}";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_INVALID_REQUEST, "regex");
    bad.structured_json = "{\"choice\": [\"yes\"]}";
    bad.sampling_json = "{\"structured\": {\"json\": true}}";
    EXPECT(kk_generate(s, &text, &bad, &out), KK_ERR_SAMPLING_PARAMS, "both set");

    /* kk_submit's own rules. */
    kk_request_id id = 77;
    EXPECT(kk_submit(s, &text, &p, NULL), KK_ERR_INVALID_ARGUMENT, "out_id");
    kk_request_params streaming = greedy(4);
    streaming.on_token = (kk_token_callback)1;
    EXPECT(kk_submit(s, &text, &streaming, &id), KK_ERR_INVALID_ARGUMENT, "on_token");
    CHECK(id == 0, "out_id not cleared: %llu", (unsigned long long)id);
    EXPECT(kk_submit(s, &empty, &p, &id), KK_ERR_INVALID_REQUEST, "empty");

    /* Unknown request ids. */
    EXPECT(kk_poll(s, 987654321, &out), KK_ERR_UNKNOWN_REQUEST, "987654321");
    EXPECT(kk_abort(s, 987654321), KK_ERR_UNKNOWN_REQUEST, "987654321");
    EXPECT(kk_poll(s, 0, &out), KK_ERR_UNKNOWN_REQUEST, NULL);
    printf("ok arguments\n");
}

/* ---- kk_generate, buffers, encodings, tokens ------------------------------------------------ */

static result reference; /* greedy 16 tokens of PROMPT */
static const char *const PROMPT = "The quick brown fox";

static void test_generate(kk_session *s) {
    kk_request_params p = greedy(16);
    EXPECT(generate(s, PROMPT, &p, &reference), KK_OK, NULL);
    CHECK(reference.n_ids == 16 && reference.finish == KK_FINISH_LENGTH, "n %zu finish %d",
          reference.n_ids, reference.finish);
    CHECK(strlen(reference.text) > 0, "no text");

    /* The same prompt as token ids gives the same tokens. */
    int32_t prompt_ids[64];
    size_t n_prompt = 0;
    EXPECT(kk_tokenize(s, PROMPT, true, prompt_ids, 0, &n_prompt), KK_ERR_BUFFER_TOO_SMALL, NULL);
    EXPECT(kk_tokenize(s, PROMPT, true, prompt_ids, 64, &n_prompt), KK_OK, NULL);
    result by_ids;
    kk_prompt as_ids = kk_prompt_from_tokens(prompt_ids, n_prompt);
    kk_output out = output_into(&by_ids);
    EXPECT(kk_generate(s, &as_ids, &p, &out), KK_OK, NULL);
    by_ids.n_ids = out.n_tokens;
    CHECK(same(&by_ids, &reference), "token prompt gave \"%s\"", by_ids.text);

    /* Too small: nothing written, sizes reported, the output kept for kk_poll. */
    char tiny[4] = "xyz";
    kk_output small = {0};
    small.text = tiny;
    small.text_capacity = sizeof tiny;
    kk_prompt prompt = kk_prompt_from_text(PROMPT);
    EXPECT(kk_generate(s, &prompt, &p, &small), KK_ERR_BUFFER_TOO_SMALL, "text needs");
    CHECK(small.text_len == strlen(reference.text), "needed %zu", small.text_len);
    CHECK(small.n_tokens == 16 && small.request_id != 0, "n %zu id %llu", small.n_tokens,
          (unsigned long long)small.request_id);
    CHECK(strcmp(tiny, "xyz") == 0, "a too-small buffer was written");
    result kept;
    out = output_into(&kept);
    EXPECT(kk_poll(s, small.request_id, &out), KK_OK, NULL);
    kept.n_ids = out.n_tokens;
    CHECK(out.finished && out.finish_reason == KK_FINISH_LENGTH, "kept output not finished");
    CHECK(same(&kept, &reference), "kept output \"%s\"", kept.text);
    EXPECT(kk_poll(s, small.request_id, &out), KK_ERR_UNKNOWN_REQUEST, NULL);

    /* A kept output can be dropped instead. */
    kk_output no_room = {0};
    no_room.token_ids = prompt_ids;
    EXPECT(kk_generate(s, &prompt, &p, &no_room), KK_ERR_BUFFER_TOO_SMALL, "token_ids needs");
    EXPECT(kk_abort(s, no_room.request_id), KK_OK, NULL);
    EXPECT(kk_poll(s, no_room.request_id, &out), KK_ERR_UNKNOWN_REQUEST, NULL);

    /* Structured output as JSON and msgpack. */
    static char encoded[65536];
    kk_output full = {0};
    full.encoded = encoded;
    full.encoded_capacity = sizeof encoded;
    kk_request_params with_logprobs = greedy(16);
    with_logprobs.sampling_json = "{\"logprobs\": 2}";
    EXPECT(kk_generate(s, &prompt, &with_logprobs, &full), KK_OK, NULL);
    CHECK(strstr(encoded, "\"finish_reason\":\"length\"") != NULL, "JSON: %.200s", encoded);
    CHECK(strstr(encoded, "\"logprobs\":[{") != NULL, "no logprobs: %.200s", encoded);
    CHECK(strstr(encoded, "\"timeline\":{") != NULL, "no timeline: %.200s", encoded);
    CHECK(full.encoded_len == strlen(encoded) && full.text_len == strlen(reference.text),
          "lengths %zu %zu", full.encoded_len, full.text_len);
    full.encoded_format = KK_FORMAT_MSGPACK;
    EXPECT(kk_generate(s, &prompt, &p, &full), KK_OK, NULL);
    CHECK(((unsigned char)encoded[0] & 0xF0) == 0x80 || (unsigned char)encoded[0] == 0xDE,
          "not a msgpack map: %02x", (unsigned char)encoded[0]);
    full.encoded_capacity = 10;
    EXPECT(kk_generate(s, &prompt, &p, &full), KK_ERR_BUFFER_TOO_SMALL, "encoded needs");
    EXPECT(kk_abort(s, full.request_id), KK_OK, NULL);

    /* Stop strings and a chat prompt. */
    kk_request_params stop = greedy(16);
    char stop_json[256];
    char stop_at[4] = {0};
    memcpy(stop_at, reference.text + strlen(reference.text) / 2, 3);
    snprintf(stop_json, sizeof stop_json, "{\"stop\": [\"%s\"]}", stop_at);
    stop.sampling_json = stop_json;
    result stopped;
    if (strchr(stop_at, '"') == NULL && strchr(stop_at, '\\') == NULL &&
        ((unsigned char)stop_at[0] < 0x80 && (unsigned char)stop_at[2] < 0x80)) {
        EXPECT(generate(s, PROMPT, &stop, &stopped), KK_OK, NULL);
        CHECK(stopped.finish == KK_FINISH_STOP && strstr(stopped.text, stop_at) == NULL &&
                  strncmp(stopped.text, reference.text, strlen(stopped.text)) == 0,
              "stop at \"%s\" gave \"%s\"", stop_at, stopped.text);
    }
    kk_prompt chat = kk_prompt_from_chat("[{\"role\": \"user\", \"content\": \"Hi there\"}]");
    result chatted;
    out = output_into(&chatted);
    EXPECT(kk_generate(s, &chat, &p, &out), KK_OK, NULL);
    CHECK(out.n_tokens == 16, "chat gave %zu tokens", out.n_tokens);

    /* Non-ASCII text round-trips whatever the locale. */
    const char *unicode = "Caf\xc3\xa9 \xe2\x98\x95 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac";
    int32_t unicode_ids[64];
    size_t n_unicode = 0;
    char back[128];
    size_t back_len = 0;
    EXPECT(kk_tokenize(s, unicode, false, unicode_ids, 64, &n_unicode), KK_OK, NULL);
    EXPECT(kk_detokenize(s, unicode_ids, n_unicode, true, back, 3, &back_len),
           KK_ERR_BUFFER_TOO_SMALL, "needs");
    CHECK(back_len == strlen(unicode), "needed %zu", back_len);
    EXPECT(kk_detokenize(s, unicode_ids, n_unicode, true, back, sizeof back, &back_len), KK_OK,
           NULL);
    CHECK(strcmp(back, unicode) == 0, "round trip gave \"%s\"", back);
    EXPECT(kk_tokenize(s, "caf\xe9", false, unicode_ids, 64, &n_unicode), KK_ERR_INVALID_ARGUMENT,
           "UTF-8");
    EXPECT(kk_detokenize(s, unicode_ids, (size_t)1 << 40, true, back, sizeof back, &back_len),
           KK_ERR_INVALID_ARGUMENT, "n_tokens");
    printf("ok generate\n");
}

/* ---- streaming and abort callbacks ---------------------------------------------------------- */

typedef struct collector {
    result r;
    size_t text_len;
    int calls;
    int stop_after; /* return false on this call (0: never) */
} collector;

static bool collect(const char *text, size_t len, const int32_t *ids, size_t n, void *data) {
    collector *c = data;
    CHECK(text[len] == '\0', "piece not NUL-terminated");
    memcpy(c->r.text + c->text_len, text, len);
    c->text_len += len;
    c->r.text[c->text_len] = '\0';
    memcpy(c->r.ids + c->r.n_ids, ids, n * sizeof(int32_t));
    c->r.n_ids += n;
    return ++c->calls != c->stop_after;
}

static bool abort_on_third_poll(void *data) {
    return ++*(int *)data >= 3;
}

static bool always(void *data) {
    (void)data;
    return true;
}

static void test_stream(kk_session *s) {
    kk_prompt prompt = kk_prompt_from_text(PROMPT);
    collector c = {0};
    kk_request_params p = greedy(16);
    p.on_token = collect;
    p.on_token_data = &c;
    kk_output out = {0};
    EXPECT(kk_generate(s, &prompt, &p, &out), KK_OK, NULL);
    CHECK(same(&c.r, &reference), "streamed \"%s\"", c.r.text);
    CHECK(c.calls >= 2 && out.finish_reason == KK_FINISH_LENGTH, "calls %d", c.calls);

    collector stopper = {0};
    stopper.stop_after = 3;
    p.on_token_data = &stopper;
    result r;
    out = output_into(&r);
    EXPECT(kk_generate(s, &prompt, &p, &out), KK_OK, NULL);
    CHECK(out.finish_reason == KK_FINISH_ABORT && out.n_tokens < 16 && stopper.calls == 3,
          "finish %d, %zu tokens, %d calls", out.finish_reason, out.n_tokens, stopper.calls);
    CHECK(strncmp(r.text, reference.text, strlen(r.text)) == 0, "stopped text \"%s\"", r.text);

    int polls = 0;
    kk_request_params q = greedy(16);
    q.should_abort = abort_on_third_poll;
    q.should_abort_data = &polls;
    out = output_into(&r);
    EXPECT(kk_generate(s, &prompt, &q, &out), KK_OK, NULL);
    CHECK(out.finish_reason == KK_FINISH_ABORT && out.n_tokens < 16 && polls == 3,
          "finish %d, %zu tokens, %d polls", out.finish_reason, out.n_tokens, polls);
    q.should_abort = always;
    EXPECT(kk_generate(s, &prompt, &q, &out), KK_OK, NULL);
    CHECK(out.finished && out.finish_reason == KK_FINISH_ABORT && out.n_tokens == 0,
          "finish %d, %zu tokens", out.finish_reason, out.n_tokens);
    printf("ok stream\n");
}

/* ---- kk_submit / kk_step / kk_poll ---------------------------------------------------------- */

static void test_loop(kk_session *s) {
    kk_prompt prompt = kk_prompt_from_text(PROMPT);
    kk_request_params p = greedy(16);
    kk_request_params long_params = greedy(200);
    int polls = 0;
    kk_request_params watched = greedy(200);
    watched.should_abort = abort_on_third_poll;
    watched.should_abort_data = &polls;
    kk_request_id a = 0, b = 0, c = 0;
    EXPECT(kk_submit(s, &prompt, &p, &a), KK_OK, NULL);
    EXPECT(kk_submit(s, &prompt, &long_params, &b), KK_OK, NULL);
    EXPECT(kk_submit(s, &prompt, &watched, &c), KK_OK, NULL);
    CHECK(a != 0 && b != 0 && c != 0 && a != b && b != c, "ids %llu %llu %llu",
          (unsigned long long)a, (unsigned long long)b, (unsigned long long)c);

    result got[3];
    memset(got, 0, sizeof got);
    size_t text_len[3] = {0, 0, 0};
    bool done[3] = {false, false, false};
    kk_request_id ids[3] = {a, b, c};
    size_t unfinished = 99;
    for (int steps = 0; steps < 100 && !(done[0] && done[1] && done[2]); steps++) {
        EXPECT(kk_step(s, &unfinished), KK_OK, NULL);
        if (steps == 4) EXPECT(kk_abort(s, b), KK_OK, NULL);
        for (int i = 0; i < 3; i++) {
            if (done[i]) continue;
            char piece[TEXT_CAP];
            int32_t piece_ids[IDS_CAP];
            kk_output out = {0};
            out.text = piece;
            out.text_capacity = 0; /* a size query first: consumes nothing */
            out.token_ids = piece_ids;
            out.token_capacity = IDS_CAP;
            kk_status status = kk_poll(s, ids[i], &out);
            CHECK(status == KK_OK || status == KK_ERR_BUFFER_TOO_SMALL, "poll: %d", status);
            out.text_capacity = out.text_len + 1;
            EXPECT(kk_poll(s, ids[i], &out), KK_OK, NULL);
            memcpy(got[i].text + text_len[i], piece, out.text_len + 1);
            text_len[i] += out.text_len;
            memcpy(got[i].ids + got[i].n_ids, piece_ids, out.n_tokens * sizeof(int32_t));
            got[i].n_ids += out.n_tokens;
            done[i] = out.finished;
            got[i].finish = out.finish_reason;
        }
    }
    CHECK(unfinished == 0, "%zu unfinished", unfinished);
    CHECK(done[0] && same(&got[0], &reference), "looped \"%s\"", got[0].text);
    CHECK(done[1] && got[1].finish == KK_FINISH_ABORT && got[1].n_ids < 200, "b: %d, %zu ids",
          got[1].finish, got[1].n_ids);
    CHECK(done[2] && got[2].finish == KK_FINISH_ABORT && polls == 3, "c: %d, %d polls",
          got[2].finish, polls);
    CHECK(strncmp(got[1].text, reference.text, strlen(got[1].text)) == 0, "b diverged");
    kk_output out = {0};
    for (int i = 0; i < 3; i++) {
        EXPECT(kk_poll(s, ids[i], &out), KK_ERR_UNKNOWN_REQUEST, "already delivered");
        EXPECT(kk_abort(s, ids[i]), KK_ERR_UNKNOWN_REQUEST, NULL);
    }
    EXPECT(kk_step(s, NULL), KK_OK, NULL); /* nothing to do */
    printf("ok loop\n");
}

/* ---- freeing a session while a call runs on it --------------------------------------------- */

typedef struct freer {
    kk_session *session;
    int calls;
} freer;

static bool free_on_second_piece(const char *text, size_t len, const int32_t *ids, size_t n,
                                 void *data) {
    freer *f = data;
    (void)text, (void)len, (void)ids, (void)n;
    if (++f->calls == 2) EXPECT(kk_session_free(f->session), KK_OK, NULL);
    return true;
}

static void test_free_while_running(const char *model) {
    freer f = {open_session(model, SETTINGS, KK_OK, NULL), 0};
    kk_prompt prompt = kk_prompt_from_text(PROMPT);
    kk_request_id pending = 0;
    EXPECT(kk_submit(f.session, &prompt, NULL, &pending), KK_OK, NULL);
    kk_request_params p = greedy(50);
    p.on_token = free_on_second_piece;
    p.on_token_data = &f;
    kk_output out = {0};
    EXPECT(kk_generate(f.session, &prompt, &p, &out), KK_ERR_INVALID_HANDLE, "closed");
    CHECK(f.calls == 2, "%d calls", f.calls);
    EXPECT(kk_poll(f.session, pending, &out), KK_ERR_INVALID_HANDLE, "not a live session");
    EXPECT(kk_step(f.session, NULL), KK_ERR_INVALID_HANDLE, "not a live session");
    printf("ok free_while_running\n");
}

/* ---- four host threads at once -------------------------------------------------------------- */

enum { THREADS = 4, ROUNDS = 3 };

typedef struct worker {
    kk_session *session;
    int index;
    result expected;
    int mismatches;
} worker;

static const char *const THREAD_PROMPTS[THREADS] = {
    "Thread zero says", "Once upon a time in a thread", "The first host thread", "Four at once"};

static void *work(void *arg) {
    worker *w = arg;
    kk_prompt prompt = kk_prompt_from_text(THREAD_PROMPTS[w->index]);
    kk_request_params p = greedy(16);
    for (int round = 0; round < ROUNDS; round++) {
        result r;
        memset(&r, 0, sizeof r);
        if (w->index == 3) { /* the caller-driven loop, stepping alongside the others */
            kk_request_id id = 0;
            EXPECT(kk_submit(w->session, &prompt, &p, &id), KK_OK, NULL);
            kk_output out = output_into(&r);
            size_t text_len = 0;
            char piece[TEXT_CAP];
            while (!out.finished) {
                EXPECT(kk_step(w->session, NULL), KK_OK, NULL);
                out = output_into(&r);
                out.text = piece;
                out.token_ids = r.ids + r.n_ids;
                out.token_capacity = IDS_CAP - r.n_ids;
                if (kk_poll(w->session, id, &out) != KK_OK) break;
                memcpy(r.text + text_len, piece, out.text_len + 1);
                text_len += out.text_len;
                r.n_ids += out.n_tokens;
            }
        } else if (w->index == 2) { /* streaming */
            collector c;
            memset(&c, 0, sizeof c);
            kk_request_params streaming = p;
            streaming.on_token = collect;
            streaming.on_token_data = &c;
            kk_output out = {0};
            EXPECT(kk_generate(w->session, &prompt, &streaming, &out), KK_OK, NULL);
            r = c.r;
        } else {
            EXPECT(generate(w->session, THREAD_PROMPTS[w->index], &p, &r), KK_OK, NULL);
        }
        if (!same(&r, &w->expected)) {
            printf("FAIL thread %d round %d: \"%s\" != \"%s\"\n", w->index, round, r.text,
                   w->expected.text);
            w->mismatches++;
        }
        /* Errors are per thread: this thread's message survives the others' failures. */
        char path[64];
        snprintf(path, sizeof path, "/no/such/model-of-thread-%d", w->index);
        kk_session_params bad = kk_session_default_params();
        bad.model_path = path;
        kk_session *none = NULL;
        EXPECT(kk_session_create(&bad, &none), KK_ERR_MODEL_NOT_FOUND, path);
        kk_request_params wrong = greedy(16);
        wrong.top_k = -2 - w->index;
        char needle[32];
        snprintf(needle, sizeof needle, "%d", -2 - w->index);
        EXPECT(kk_generate(w->session, &prompt, &wrong, &(kk_output){0}), KK_ERR_SAMPLING_PARAMS,
               needle);
    }
    return NULL;
}

/* A long generation must not starve a short one that starts while it runs. */
typedef struct race {
    kk_session *session;
    int long_started;
    int short_done;
} race;

static bool note_start(const char *text, size_t len, const int32_t *ids, size_t n, void *data) {
    (void)text, (void)len, (void)ids, (void)n;
    __atomic_store_n(&((race *)data)->long_started, 1, __ATOMIC_RELEASE);
    return true;
}

static void *short_request(void *arg) {
    race *r = arg;
    while (!__atomic_load_n(&r->long_started, __ATOMIC_ACQUIRE)) {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    result out;
    kk_request_params p = greedy(4);
    EXPECT(generate(r->session, "A short one", &p, &out), KK_OK, NULL);
    __atomic_store_n(&r->short_done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void test_no_starvation(kk_session *s) {
    race r = {s, 0, 0};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, short_request, &r) == 0, "pthread_create");
    kk_prompt prompt = kk_prompt_from_text("A long one");
    kk_request_params p = greedy(200);
    p.on_token = note_start;
    p.on_token_data = &r;
    kk_output out = {0};
    EXPECT(kk_generate(s, &prompt, &p, &out), KK_OK, NULL);
    int short_first = __atomic_load_n(&r.short_done, __ATOMIC_ACQUIRE);
    pthread_join(thread, NULL);
    CHECK(out.n_tokens == 200 && short_first, "the 4-token request finished %s the 200-token one",
          short_first ? "before" : "after");
}

static void test_threads(kk_session *s) {
    worker workers[THREADS];
    for (int i = 0; i < THREADS; i++) {
        memset(&workers[i], 0, sizeof workers[i]);
        workers[i].session = s;
        workers[i].index = i;
        kk_request_params p = greedy(16);
        EXPECT(generate(s, THREAD_PROMPTS[i], &p, &workers[i].expected), KK_OK, NULL);
    }
    int before = os_threads();
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_create(&threads[i], NULL, work, &workers[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        CHECK(workers[i].mismatches == 0, "thread %d: %d mismatches", i, workers[i].mismatches);
    }
    /* A joined thread's OpenMP pool threads exit after it, on their own: allow them 2 s. */
    int after = os_threads();
    for (int i = 0; i < 200 && after > before; i++) {
        nanosleep(&(struct timespec){0, 10000000}, NULL);
        after = os_threads();
    }
    CHECK(after <= before, "%d OS threads before the workers, %d after they joined", before,
          after);
    test_no_starvation(s);
    printf("ok threads (%d OS threads before and %d after)\n", before, after);
}

/* ---- the end -------------------------------------------------------------------------------- */

static void test_shutdown(kk_session *s) {
    EXPECT(kk_session_free(s), KK_OK, NULL);
    EXPECT(kk_session_free(s), KK_ERR_INVALID_HANDLE, "not a live session");
    kk_session *other = open_session(NULL, "{\"progress\": false, \"no_such\": 1}",
                                     KK_ERR_CONFIG, "no_such");
    (void)other;
    EXPECT(kk_runtime_shutdown(), KK_OK, NULL);
    kk_session *after = (kk_session *)1;
    EXPECT(kk_session_create(NULL, &after), KK_ERR_NOT_INITIALIZED, "shut down");
    EXPECT(kk_runtime_init(NULL), KK_ERR_NOT_INITIALIZED, "shut down");
    EXPECT(kk_runtime_shutdown(), KK_ERR_NOT_INITIALIZED, "shut down");
    printf("ok shutdown\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
        return 2;
    }
    test_before_init();
    test_init();
    kk_session *s = test_sessions(argv[1]);
    test_handles(argv[1]);
    test_arguments(s);
    test_generate(s);
    test_stream(s);
    test_loop(s);
    test_free_while_running(argv[1]);
    test_threads(s);
    test_shutdown(s);
    if (failures != 0) {
        printf("%d FAILED\n", failures);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
