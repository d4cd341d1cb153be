/* Several sessions on one model, each driven by its own thread at the same time: every request's
 * tokens equal those of the same session alone. Usage: threads_test MODEL_DIR; exit 0 on success. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "libkk.h"

#define NUM_SESSIONS 4
#define NUM_ROUNDS 3
#define NUM_PROMPTS 3
#define MAX_TOKENS 16

static const char *PROMPTS[NUM_PROMPTS] = {"alpha beta gamma", "one two", "the quick brown fox"};

typedef struct {
    kk_session *session;
    int32_t tokens[NUM_ROUNDS][NUM_PROMPTS][MAX_TOKENS];
    size_t n_tokens[NUM_ROUNDS][NUM_PROMPTS];
    kk_status status;
} worker;

static kk_status generate(kk_session *session, const char *text, int32_t *tokens, size_t *n) {
    kk_request_params params = kk_request_default_params();
    params.max_tokens = MAX_TOKENS;
    params.temperature = 0.8;
    params.seed = 7;
    params.ignore_eos = true;
    kk_prompt prompt = kk_prompt_from_text(text);
    kk_output out = {0};
    out.token_ids = tokens;
    out.token_capacity = MAX_TOKENS;
    kk_status status = kk_generate(session, &prompt, &params, &out);
    *n = out.n_tokens;
    return status;
}

static void *run(void *arg) {
    worker *w = arg;
    for (int round = 0; round < NUM_ROUNDS; round++) {
        for (int p = 0; p < NUM_PROMPTS; p++) {
            w->status = generate(w->session, PROMPTS[p], w->tokens[round][p], &w->n_tokens[round][p]);
            if (w->status != KK_OK) return NULL;
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
        return 2;
    }
    if (kk_runtime_init(NULL) != KK_OK) {
        fprintf(stderr, "init: %s\n", kk_last_error());
        return 1;
    }
    kk_session_params params = kk_session_default_params();
    params.model_path = argv[1];
    params.settings_json = "{\"progress\": false, \"num_threads\": 1}";
    static worker workers[NUM_SESSIONS];
    for (int i = 0; i < NUM_SESSIONS; i++) {
        if (kk_session_create(&params, &workers[i].session) != KK_OK) {
            fprintf(stderr, "session %d: %s\n", i, kk_last_error());
            return 1;
        }
    }
    /* Each prompt alone, on the first session, before any thread starts. */
    int32_t alone[NUM_PROMPTS][MAX_TOKENS];
    size_t n_alone[NUM_PROMPTS];
    for (int p = 0; p < NUM_PROMPTS; p++) {
        if (generate(workers[0].session, PROMPTS[p], alone[p], &n_alone[p]) != KK_OK) {
            fprintf(stderr, "alone: %s\n", kk_last_error());
            return 1;
        }
    }
    pthread_t threads[NUM_SESSIONS];
    for (int i = 0; i < NUM_SESSIONS; i++) pthread_create(&threads[i], NULL, run, &workers[i]);
    for (int i = 0; i < NUM_SESSIONS; i++) pthread_join(threads[i], NULL);
    int mismatches = 0;
    for (int i = 0; i < NUM_SESSIONS; i++) {
        if (workers[i].status != KK_OK) {
            fprintf(stderr, "session %d failed: %s\n", i, kk_status_string(workers[i].status));
            return 1;
        }
        for (int round = 0; round < NUM_ROUNDS; round++) {
            for (int p = 0; p < NUM_PROMPTS; p++) {
                size_t n = workers[i].n_tokens[round][p];
                if (n != n_alone[p] ||
                    memcmp(workers[i].tokens[round][p], alone[p], n * sizeof(int32_t)) != 0) {
                    fprintf(stderr, "session %d round %d prompt %d differs\n", i, round, p);
                    mismatches++;
                }
            }
        }
        kk_session_free(workers[i].session);
    }
    kk_runtime_shutdown();
    printf("%d sessions x %d rounds: %d mismatches\n", NUM_SESSIONS, NUM_ROUNDS, mismatches);
    return mismatches == 0 ? 0 : 1;
}
