/* dlopen_test.c: loads libkk.so at run time with RTLD_LOCAL (the host links neither libkk nor
 * libpython), starts the runtime from a chosen Python and reports which environment it runs.
 *
 *   dlopen_test LIBRARY PYTHON|- MODEL|- [PROMPT]
 *
 * PYTHON "-" passes NULL to kk_runtime_init. Prints "info: <kk_runtime_info JSON>", then with a
 * MODEL "text: <greedy continuation of PROMPT, 12 tokens at most>", then "done". Exit status 3
 * when the runtime does not start (with "init failed: STATUS: message" on stdout).
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "libkk.h"

#define RESOLVE(name)                                                                              \
    __typeof__(&name) p_##name = (__typeof__(&name))dlsym(library, #name);                         \
    if (p_##name == NULL) {                                                                        \
        printf("missing symbol %s\n", #name);                                                      \
        return 1;                                                                                  \
    }

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s LIBRARY PYTHON|- MODEL|- [PROMPT]\n", argv[0]);
        return 2;
    }
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        printf("dlopen failed: %s\n", dlerror());
        return 1;
    }
    RESOLVE(kk_runtime_init)
    RESOLVE(kk_runtime_info)
    RESOLVE(kk_runtime_shutdown)
    RESOLVE(kk_last_error)
    RESOLVE(kk_status_string)
    RESOLVE(kk_session_create)
    RESOLVE(kk_session_default_params)
    RESOLVE(kk_session_free)
    RESOLVE(kk_request_default_params)
    RESOLVE(kk_generate)

    const char *python = strcmp(argv[2], "-") == 0 ? NULL : argv[2];
    kk_status status = p_kk_runtime_init(python);
    if (status != KK_OK) {
        printf("init failed: %s: %s\n", p_kk_status_string(status), p_kk_last_error());
        return 3;
    }
    char info[4096];
    size_t length = 0;
    if (p_kk_runtime_info(KK_FORMAT_JSON, info, sizeof info, &length) != KK_OK) {
        printf("kk_runtime_info failed: %s\n", p_kk_last_error());
        return 1;
    }
    printf("info: %s\n", info);

    if (strcmp(argv[3], "-") != 0) {
        kk_session_params session_params = p_kk_session_default_params();
        session_params.model_path = argv[3];
        session_params.settings_json = "{\"max_num_seqs\": 4, \"progress\": false}";
        kk_session *session = NULL;
        if ((status = p_kk_session_create(&session_params, &session)) != KK_OK) {
            printf("kk_session_create failed: %s\n", p_kk_last_error());
            return 1;
        }
        kk_request_params params = p_kk_request_default_params();
        params.max_tokens = 12;
        params.temperature = 0.0;
        kk_prompt prompt = kk_prompt_from_text(argc > 4 ? argv[4] : "Hello");
        char text[1024];
        kk_output out = {0};
        out.text = text;
        out.text_capacity = sizeof text;
        if ((status = p_kk_generate(session, &prompt, &params, &out)) != KK_OK) {
            printf("kk_generate failed: %s\n", p_kk_last_error());
            return 1;
        }
        printf("text: %s\n", text);
        p_kk_session_free(session);
    }
    if (p_kk_runtime_shutdown() != KK_OK) {
        printf("kk_runtime_shutdown failed: %s\n", p_kk_last_error());
        return 1;
    }
    printf("done\n");
    return 0;
}
