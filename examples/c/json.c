/* json.c: an answer that always parses, through libkk's C ABI: the request carries a JSON Schema
 * (kk_request_params.structured_json) and the output is JSON that matches it.
 *
 *   python bindings_c/build.py --out build/libkk
 *   gcc -std=c99 -I build/libkk examples/c/json.c -L build/libkk -lkk \
 *       -Wl,-rpath,"$PWD/build/libkk" -o json
 *   ./json [-m MODEL] [-s SEED] "Invent a character for a fantasy novel."
 *
 * Without -m it runs the default model (SmolLM2-135M-Instruct). It prints the JSON, then the
 * fields read back from it.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "libkk.h"

/* The answer's shape: every field required, the class one of three, the age bounded. */
static const char SCHEMA[] =
    "{\"json_schema\": {\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\", \"maxLength\": 40},"
    "\"class\": {\"enum\": [\"warrior\", \"mage\", \"thief\"]},"
    "\"age\": {\"type\": \"integer\", \"minimum\": 16, \"maximum\": 99}},"
    "\"required\": [\"name\", \"class\", \"age\"], \"additionalProperties\": false}}";

static int fail(const char *what, kk_status status) {
    fprintf(stderr, "%s failed: %s: %s\n", what, kk_status_string(status), kk_last_error());
    return 1;
}

/* The text right after "KEY": (whitespace skipped), or NULL. The schema admits no nested
 * objects and no other keys, so the first match is the field. */
static const char *field(const char *json, const char *key) {
    char quoted[32];
    snprintf(quoted, sizeof quoted, "\"%s\"", key);
    const char *at = strstr(json, quoted);
    if (at == NULL) return NULL;
    at += strlen(quoted);
    while (*at == ' ' || *at == '\n' || *at == '\t' || *at == '\r') at++;
    if (*at++ != ':') return NULL;
    while (*at == ' ' || *at == '\n' || *at == '\t' || *at == '\r') at++;
    return at;
}

/* A string field's value (no escapes decoded: enough for a name) into out, or -1. */
static int string_field(const char *json, const char *key, char *out, size_t capacity) {
    const char *at = field(json, key);
    if (at == NULL || *at != '"') return -1;
    const char *end = at + 1;
    while (*end != '\0' && *end != '"') end += (*end == '\\' && end[1] != '\0') ? 2 : 1;
    if (*end != '"' || (size_t)(end - at - 1) >= capacity) return -1;
    memcpy(out, at + 1, (size_t)(end - at - 1));
    out[end - at - 1] = '\0';
    return 0;
}

int main(int argc, char **argv) {
    const char *model = NULL;
    long seed = 0;
    for (int option; (option = getopt(argc, argv, "m:s:")) != -1;) {
        if (option == 'm') {
            model = optarg;
        } else if (option == 's') {
            seed = strtol(optarg, NULL, 10);
        } else {
            return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: %s [-m MODEL] [-s SEED] PROMPT\n", argv[0]);
        return 2;
    }

    kk_status status = kk_runtime_init(NULL);
    if (status != KK_OK) return fail("kk_runtime_init", status);
    kk_session_params session_params = kk_session_default_params();
    session_params.model_path = model; /* NULL: the default model */
    kk_session *session = NULL;
    status = kk_session_create(&session_params, &session);
    if (status != KK_OK) return fail("kk_session_create", status);

    kk_request_params params = kk_request_default_params();
    params.max_tokens = 200;
    params.temperature = 0.8;
    params.seed = seed;
    params.structured_json = SCHEMA;
    /* A chat prompt: the model's chat template renders it. */
    char messages[1024];
    snprintf(messages, sizeof messages,
             "[{\"role\": \"user\", \"content\": \"%s Answer in JSON with name, class, age.\"}]",
             argv[optind]);
    kk_prompt prompt = kk_prompt_from_chat(messages);

    char text[2048];
    kk_output out = {0};
    out.text = text;
    out.text_capacity = sizeof text;
    status = kk_generate(session, &prompt, &params, &out);
    if (status != KK_OK) return fail("kk_generate", status);
    printf("%s\n", text);

    char name[64], class_name[16];
    const char *age = field(text, "age");
    if (string_field(text, "name", name, sizeof name) != 0 ||
        string_field(text, "class", class_name, sizeof class_name) != 0 || age == NULL) {
        fprintf(stderr, "the answer lacks a field (finish reason %d)\n", (int)out.finish_reason);
        return 1;
    }
    printf("name=%s class=%s age=%ld\n", name, class_name, strtol(age, NULL, 10));

    kk_session_free(session);
    kk_runtime_shutdown();
    return 0;
}
