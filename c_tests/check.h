/*
 * Minimal check helpers shared by the C tests (valid as C11 and C++17).
 *
 * Every check prints one line, "PASS <what>" or "FAIL <what>", which
 * c_tests/run.sh counts; a test ends with check_summary(), whose value is
 * the exit status (nonzero when any check failed).
 */
#ifndef ENGRAM_C_TESTS_CHECK_H
#define ENGRAM_C_TESTS_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Around code that calls the header's deprecated aliases on purpose (the
   tests of those aliases): their deprecation warning, an error under
   -Werror, is silenced there and nowhere else. */
#if defined(__GNUC__) || defined(__clang__)
#define CHECK_DEPRECATED_BEGIN \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
#define CHECK_DEPRECATED_END _Pragma("GCC diagnostic pop")
#else
#define CHECK_DEPRECATED_BEGIN
#define CHECK_DEPRECATED_END
#endif

/* Copy the file `src` to `dst` whole; 1 on success, 0 on any error. */
static inline int copy_whole_file(const char *src, const char *dst) {
    FILE *f = fopen(src, "rb");
    if (!f) return 0;
    FILE *o = fopen(dst, "wb");
    if (!o) {
        fclose(f);
        return 0;
    }
    char buf[65536];
    size_t n;
    int ok = 1;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        if (fwrite(buf, 1, n, o) != n) ok = 0;
    }
    fclose(f);
    if (fclose(o) != 0) ok = 0;
    return ok;
}

static int g_checks_passed = 0;
static int g_checks_failed = 0;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static inline int check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(ok ? "PASS " : "FAIL ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
    fflush(stdout);
    if (ok) {
        g_checks_passed++;
    } else {
        g_checks_failed++;
    }
    return ok;
}

/* Extra detail for a failed check, indented so run.sh does not count it. */
#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static inline void note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("    ", stdout);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
    fflush(stdout);
}

static inline int check_summary(const char *test) {
    printf("# %s: %d passed, %d failed\n", test, g_checks_passed, g_checks_failed);
    fflush(stdout);
    return g_checks_failed ? 1 : 0;
}

#endif /* ENGRAM_C_TESTS_CHECK_H */
