/*
 * The header can be included twice (include guard), compiles as C11 and as
 * C++17, and its version macros match the library it is linked with.
 */
#include "engram.h"
#include "engram.h" /* twice on purpose: the include guard must hold */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define STR_(x) #x
#define STR(x) STR_(x)

#if !defined(ENGRAM_VERSION_MAJOR) || !defined(ENGRAM_VERSION_MINOR) || \
    !defined(ENGRAM_VERSION_PATCH) || !defined(ENGRAM_VERSION_STRING)
#error "engram.h must define ENGRAM_VERSION_MAJOR/MINOR/PATCH/STRING"
#endif

/* The numeric macros are usable in #if. */
#if ENGRAM_VERSION_MAJOR < 0 || ENGRAM_VERSION_MINOR < 0 || ENGRAM_VERSION_PATCH < 0
#error "negative version"
#endif

int main(void) {
    const char *lib = engram_version();
    check(lib != NULL, "engram_version() is not NULL");
    if (!lib) return check_summary("test_header_twice");

    check(strcmp(lib, ENGRAM_VERSION_STRING) == 0,
          "engram_version() \"%s\" equals ENGRAM_VERSION_STRING \"%s\"", lib,
          ENGRAM_VERSION_STRING);

    char built[64];
    snprintf(built, sizeof built, "%d.%d.%d", ENGRAM_VERSION_MAJOR, ENGRAM_VERSION_MINOR,
             ENGRAM_VERSION_PATCH);
    check(strcmp(built, ENGRAM_VERSION_STRING) == 0,
          "MAJOR.MINOR.PATCH macros \"%s\" spell ENGRAM_VERSION_STRING", built);
    check(strcmp(built, lib) == 0, "MAJOR.MINOR.PATCH macros \"%s\" equal engram_version()",
          built);

    int maj = -1, min = -1, pat = -1;
    char tail = 0;
    int got = sscanf(lib, "%d.%d.%d%c", &maj, &min, &pat, &tail);
    check(got == 3 && maj == ENGRAM_VERSION_MAJOR && min == ENGRAM_VERSION_MINOR &&
              pat == ENGRAM_VERSION_PATCH,
          "engram_version() parses as %d.%d.%d (header " STR(ENGRAM_VERSION_MAJOR) "." STR(
              ENGRAM_VERSION_MINOR) "." STR(ENGRAM_VERSION_PATCH) ")",
          maj, min, pat);
    check(engram_version() == lib, "engram_version() returns a stable static string");

    /* The constants and types the header promises are there. */
    check(ENGRAM_STATUS_OK == 0, "ENGRAM_STATUS_OK is 0");
    check(ENGRAM_TOKEN_DEAD == -1 && ENGRAM_ROW_ID_DEAD == -1, "dead markers are -1");
    check(ENGRAM_FP8_SCALE_BLOCK == 32, "ENGRAM_FP8_SCALE_BLOCK is 32");
    check(sizeof(engram_config) > sizeof(size_t) && sizeof(engram_layer_weights) > sizeof(size_t),
          "engram_config and engram_layer_weights are complete types");
    return check_summary("test_header_twice");
}
