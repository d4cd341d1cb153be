/* tp_generate.c: greedy text through the C ABI with engine settings given as JSON.
 *
 *   ./tp_generate MODEL SETTINGS_JSON MAX_TOKENS PROMPT
 */
#include <stdio.h>
#include <stdlib.h>

#include "libkk.h"

static int fail(const char *what, kk_status status) {
    fprintf(stderr, "%s failed: %s: %s\n", what, kk_status_string(status), kk_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL SETTINGS_JSON MAX_TOKENS PROMPT\n", argv[0]);
        return 2;
    }
    kk_status status = kk_runtime_init(NULL);
    if (status != KK_OK) return fail("kk_runtime_init", status);
    kk_session_params session_params = kk_session_default_params();
    session_params.model_path = argv[1];
    session_params.settings_json = argv[2];
    kk_session *session = NULL;
    status = kk_session_create(&session_params, &session);
    if (status != KK_OK) return fail("kk_session_create", status);

    kk_request_params params = kk_request_default_params();
    params.max_tokens = atoi(argv[3]);
    params.temperature = 0.0;
    kk_prompt prompt = kk_prompt_from_text(argv[4]);
    static char text[4096];
    kk_output out = {0};
    out.text = text;
    out.text_capacity = sizeof text;
    status = kk_generate(session, &prompt, &params, &out);
    if (status != KK_OK) return fail("kk_generate", status);
    printf("%s\n", text);
    status = kk_session_free(session);
    if (status != KK_OK) return fail("kk_session_free", status);
    return kk_runtime_shutdown() == KK_OK ? 0 : 1;
}
