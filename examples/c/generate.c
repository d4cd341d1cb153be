/* generate.c: a prompt in, text out, through libkk's C ABI.
 *
 *   python bindings_c/build.py --out build/libkk
 *   gcc -std=c99 -I build/libkk examples/c/generate.c -L build/libkk -lkk \
 *       -Wl,-rpath,"$PWD/build/libkk" -o generate
 *   ./generate [-m MODEL] [-n MAX_TOKENS] "The capital of France is"
 *
 * Without -m it runs the default model (SmolLM2-135M-Instruct); decoding is greedy.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "libkk.h"

static int fail(const char *what, kk_status status) {
    fprintf(stderr, "%s failed: %s: %s\n", what, kk_status_string(status), kk_last_error());
    return 1;
}

int main(int argc, char **argv) {
    const char *model = NULL;
    int max_tokens = 32;
    for (int option; (option = getopt(argc, argv, "m:n:")) != -1;) {
        if (option == 'm') {
            model = optarg;
        } else if (option == 'n') {
            max_tokens = atoi(optarg);
        } else {
            return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: %s [-m MODEL] [-n MAX_TOKENS] PROMPT\n", argv[0]);
        return 2;
    }

    kk_status status = kk_runtime_init(NULL); /* the Python environment libkk was built from */
    if (status != KK_OK) return fail("kk_runtime_init", status);

    kk_session_params session_params = kk_session_default_params();
    session_params.model_path = model; /* NULL: the default model */
    session_params.settings_json = "{\"max_num_seqs\": 4}"; /* engine settings, as JSON */
    kk_session *session = NULL;
    status = kk_session_create(&session_params, &session);
    if (status != KK_OK) return fail("kk_session_create", status);

    kk_request_params params = kk_request_default_params();
    params.max_tokens = max_tokens;
    params.temperature = 0.0; /* greedy */
    kk_prompt prompt = kk_prompt_from_text(argv[optind]);

    char small[64];
    kk_output out = {0};
    out.text = small;
    out.text_capacity = sizeof small;
    status = kk_generate(session, &prompt, &params, &out);
    char *text = small;
    if (status == KK_ERR_BUFFER_TOO_SMALL) { /* the output waits under out.request_id */
        text = malloc(out.text_len + 1);
        out.text = text;
        out.text_capacity = out.text_len + 1;
        status = kk_poll(session, out.request_id, &out);
    }
    if (status != KK_OK) return fail("kk_generate", status);
    printf("%s\n", text);
    static const char *const reasons[] = {"none", "stop", "length", "abort", "error"};
    fprintf(stderr, "[%zu tokens, %s]\n", out.n_tokens, reasons[out.finish_reason]);
    if (text != small) free(text);

    kk_session_free(session);
    return kk_runtime_shutdown() == KK_OK ? 0 : 1;
}
