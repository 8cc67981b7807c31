/* xattrprobe: a file's extended attributes as a program in the guest sees them, for
 * tests/e2e/test_confinement.py (the busybox image has no getfattr or setfattr).
 *
 *   xattrprobe FILE OP...   one line per OP, in order:
 *     get:NAME        `ok <value in hex>` (`ok -` when empty)
 *     set:NAME=HEX    `ok`                 (the value given in hex: binary ones too)
 *     remove:NAME     `ok`
 *     list            `ok <name> <name>...`
 *   or, for each, the error's name (`EPERM`, `ENODATA`...). Nothing follows a symlink. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>

static void said(const char *op, long result) {
    if (result < 0)
        printf("%s %s\n", op, strerrorname_np(errno));
    else
        printf("%s ok\n", op);
}

int main(int argc, char **argv) {
    static char buf[65536], value[65536];
    if (argc < 3) {
        fprintf(stderr, "usage: xattrprobe FILE get:NAME|set:NAME=HEX|remove:NAME|list...\n");
        return 2;
    }
    const char *file = argv[1];
    for (int i = 2; i < argc; i++) {
        char *op = argv[i];
        if (strncmp(op, "get:", 4) == 0) {
            ssize_t n = lgetxattr(file, op + 4, buf, sizeof buf);
            if (n < 0) {
                said(op, -1);
                continue;
            }
            printf("%s ok ", op);
            for (ssize_t j = 0; j < n; j++)
                printf("%02x", (unsigned char)buf[j]);
            printf(n ? "\n" : "-\n");
        } else if (strncmp(op, "set:", 4) == 0) {
            char name[256];
            const char *eq = strchr(op + 4, '=');
            size_t len = eq ? (size_t)(eq - op - 4) : 0, n = 0;
            if (!eq || len >= sizeof name || strlen(eq + 1) % 2)
                return fprintf(stderr, "xattrprobe: %s: want set:NAME=HEX\n", op), 2;
            memcpy(name, op + 4, len);
            name[len] = 0;
            for (const char *h = eq + 1; *h && n < sizeof value; h += 2) {
                char byte[3] = {h[0], h[1], 0};
                value[n++] = (char)strtoul(byte, NULL, 16);
            }
            said(op, lsetxattr(file, name, value, n, 0));
        } else if (strncmp(op, "remove:", 7) == 0) {
            said(op, lremovexattr(file, op + 7));
        } else if (strcmp(op, "list") == 0) {
            ssize_t n = llistxattr(file, buf, sizeof buf);
            if (n < 0) {
                said(op, -1);
                continue;
            }
            printf("%s ok", op);
            for (char *name = buf; name < buf + n; name += strlen(name) + 1)
                printf(" %s", name);
            printf("\n");
        } else {
            return fprintf(stderr, "xattrprobe: unknown op %s\n", op), 2;
        }
    }
    return 0;
}
