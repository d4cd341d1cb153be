// stream.cpp: a prompt in, text streamed out as it is generated, through libkk's C ABI.
//
//   python bindings_c/build.py --out build/libkk
//   B=$PWD/build/libkk; g++ -std=c++17 -I $B examples/c/stream.cpp -L $B -lkk -Wl,-rpath,$B -o stream
//   ./stream [-m MODEL] [-n MAX_TOKENS] "Once upon a time"
//
// Ctrl-C stops the generation (the abort callback sees it between steps) and still exits cleanly.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include "libkk.h"

namespace {

std::atomic<bool> interrupted{false};

int fail(const char *what, kk_status status) {
    std::fprintf(stderr, "%s failed: %s: %s\n", what, kk_status_string(status), kk_last_error());
    return 1;
}

}  // namespace

int main(int argc, char **argv) {
    const char *model = nullptr;
    int max_tokens = 64;
    for (int option; (option = getopt(argc, argv, "m:n:")) != -1;) {
        if (option == 'm') model = optarg;
        else if (option == 'n') max_tokens = std::atoi(optarg);
        else return 2;
    }
    if (optind != argc - 1) {
        std::fprintf(stderr, "usage: %s [-m MODEL] [-n MAX_TOKENS] PROMPT\n", argv[0]);
        return 2;
    }
    std::signal(SIGINT, [](int) { interrupted = true; });

    if (kk_status status = kk_runtime_init(nullptr); status != KK_OK) return fail("init", status);
    kk_session_params session_params = kk_session_default_params();
    session_params.model_path = model;  // nullptr: the default model
    session_params.settings_json = R"({"max_num_seqs": 4})";  // engine settings, as JSON
    kk_session *session = nullptr;
    if (kk_status status = kk_session_create(&session_params, &session); status != KK_OK)
        return fail("kk_session_create", status);

    std::string streamed;
    kk_request_params params = kk_request_default_params();
    params.max_tokens = max_tokens;
    params.temperature = 0.0;  // greedy
    params.on_token = [](const char *text, size_t len, const int32_t *, size_t, void *data) {
        static_cast<std::string *>(data)->append(text, len);
        std::fwrite(text, 1, len, stdout);
        std::fflush(stdout);
        return true;  // false would stop the request
    };
    params.on_token_data = &streamed;
    params.should_abort = [](void *) { return interrupted.load(); };

    kk_prompt prompt = kk_prompt_from_text(argv[optind]);
    kk_output out = {};  // no buffers: the text already came through on_token
    kk_status status = kk_generate(session, &prompt, &params, &out);
    std::printf("\n");
    if (status != KK_OK) return fail("kk_generate", status);
    std::fprintf(stderr, "[%zu bytes in %zu tokens%s]\n", streamed.size(), out.n_tokens,
                 out.finish_reason == KK_FINISH_ABORT ? ", interrupted" : "");

    kk_session_free(session);
    return kk_runtime_shutdown() == KK_OK ? 0 : 1;
}
