/* fsprobe: what ordinary programs expect of a file system, checked by effect, and the
 * speed of common file operations (issue 29: podvm against runc, in a container's root
 * fs and in a hostPath volume). Built `gcc -static -O2` so that it runs in any image.
 *
 *   fsprobe semantics DIR   one line per case, `ok <case>` or `FAIL <case>: <why>`;
 *                           exit 0 only when every case is ok
 *   fsprobe speed DIR N     `create N <s>`, `stat N <s>`, `unlink N <s>` (4 KiB files),
 *                           `write64 <s>` (64 MiB and fsync), `read64 <s>`
 *
 * Everything happens in a fresh directory under DIR, removed at the end. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

static char why[512];
static char work[4096];

#define CHECK(cond, what) do { if (!(cond)) { \
    snprintf(why, sizeof why, "%s: %s", what, strerror(errno)); return -1; } } while (0)
#define EXPECT(cond, ...) do { if (!(cond)) { \
    snprintf(why, sizeof why, __VA_ARGS__); return -1; } } while (0)

static const char *at(const char *name)
{
    static char buf[4][4200];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", work, name);
    return p;
}

static int put(const char *path, const char *text)
{
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
    CHECK(fd >= 0, "open for writing");
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text), "write");
    CHECK(close(fd) == 0, "close");
    return 0;
}

static int same_at(int fd, off_t off, const char *want, const char *what)
{
    char got[256] = {0};
    ssize_t n = pread(fd, got, sizeof got - 1, off);
    CHECK(n >= 0, what);
    EXPECT((size_t)n == strlen(want) && memcmp(got, want, n) == 0,
           "%s: read back \"%.*s\", not \"%s\"", what, (int)n, got, want);
    return 0;
}

static int same_file(const char *path, const char *want)
{
    int fd = open(path, O_RDONLY), rc;
    CHECK(fd >= 0, "open for reading");
    rc = same_at(fd, 0, want, "read by name");
    close(fd);
    return rc;
}

static int unlinked_open(void)
{
    struct stat st;
    int fd = open(at("unlinked"), O_CREAT | O_RDWR, 0644);
    CHECK(fd >= 0, "open");
    CHECK(write(fd, "hello world", 11) == 11, "write");
    CHECK(unlink(at("unlinked")) == 0, "unlink");
    CHECK(ftruncate(fd, 5) == 0, "ftruncate after unlink");
    CHECK(fstat(fd, &st) == 0, "fstat after unlink");
    EXPECT(st.st_size == 5 && st.st_nlink == 0, "fstat: size %lld nlink %lu, not 5 and 0",
           (long long)st.st_size, (unsigned long)st.st_nlink);
    CHECK(pwrite(fd, "!", 1, 5) == 1, "write after unlink");
    return same_at(fd, 0, "hello!", "read after unlink") || close(fd);
}

static int o_tmpfile(void)
{
    char proc[64];
    int fd = open(work, O_TMPFILE | O_RDWR, 0600);
    CHECK(fd >= 0, "open(dir, O_TMPFILE)");
    CHECK(write(fd, "anonymous", 9) == 9, "write");
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    CHECK(linkat(AT_FDCWD, proc, AT_FDCWD, at("named-tmpfile"), AT_SYMLINK_FOLLOW) == 0,
          "linkat via /proc/self/fd");
    close(fd);
    return same_file(at("named-tmpfile"), "anonymous");
}

static int unix_socket(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char got = 0;
    int s, c, a;
    EXPECT(strlen(at("sock")) < sizeof sa.sun_path, "path too long for a socket");
    strcpy(sa.sun_path, at("sock"));
    CHECK((s = socket(AF_UNIX, SOCK_STREAM, 0)) >= 0, "socket");
    CHECK(bind(s, (struct sockaddr *)&sa, sizeof sa) == 0, "bind");
    CHECK(listen(s, 1) == 0, "listen");
    CHECK((c = socket(AF_UNIX, SOCK_STREAM, 0)) >= 0, "socket");
    CHECK(connect(c, (struct sockaddr *)&sa, sizeof sa) == 0, "connect");
    CHECK((a = accept(s, NULL, NULL)) >= 0, "accept");
    CHECK(write(c, "x", 1) == 1, "send");
    CHECK(read(a, &got, 1) == 1, "recv");
    EXPECT(got == 'x', "received %d, not 'x'", got);
    close(a), close(c), close(s);
    return 0;
}

/* The exit status of a child running `fn`: errno of its failure, or 0. */
static int in_child(int (*fn)(void))
{
    int status;
    pid_t pid = fork();
    if (pid == 0)
        _exit(fn() == 0 ? 0 : (errno ? errno : 255));
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return -1;
    return WEXITSTATUS(status);
}

static int take_record_lock(void)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 100};
    int fd = open(at("locked"), O_RDWR);
    return fd < 0 ? -1 : fcntl(fd, F_SETLK, &fl);
}

static int record_lock(void)
{
    int rc;
    CHECK(put(at("locked"), "data") == 0, "create");
    errno = 0;
    CHECK(take_record_lock() == 0, "F_SETLK as first taker");
    rc = in_child(take_record_lock);
    EXPECT(rc == EAGAIN || rc == EACCES, "a child's F_SETLK on the held range: %s",
           rc == 0 ? "granted" : rc < 0 ? "child died" : strerror(rc));
    return 0;
}

static int take_flock(void)
{
    int fd = open(at("flocked"), O_RDONLY);
    return fd < 0 ? -1 : flock(fd, LOCK_EX | LOCK_NB);
}

static int whole_file_lock(void)
{
    int rc;
    CHECK(put(at("flocked"), "data") == 0, "create");
    errno = 0;
    CHECK(take_flock() == 0, "flock(LOCK_EX|LOCK_NB) as first taker");
    rc = in_child(take_flock);
    EXPECT(rc == EWOULDBLOCK, "a child's flock(LOCK_EX|LOCK_NB): %s",
           rc == 0 ? "granted" : rc < 0 ? "child died" : strerror(rc));
    return 0;
}

static int fifo(void)
{
    char got = 0;
    int fd;
    CHECK(mkfifo(at("fifo"), 0600) == 0, "mkfifo");
    CHECK((fd = open(at("fifo"), O_RDWR)) >= 0, "open O_RDWR");
    CHECK(write(fd, "f", 1) == 1, "write");
    CHECK(read(fd, &got, 1) == 1, "read");
    EXPECT(got == 'f', "read %d, not 'f'", got);
    return close(fd);
}

static int nanosecond_mtime(void)
{
    struct timespec ts[2] = {{.tv_nsec = UTIME_OMIT}, {1700000000, 123456789}};
    struct stat st;
    CHECK(put(at("timed"), "t") == 0, "create");
    CHECK(utimensat(AT_FDCWD, at("timed"), ts, 0) == 0, "utimensat");
    CHECK(stat(at("timed"), &st) == 0, "stat");
    EXPECT(st.st_mtim.tv_sec == 1700000000 && st.st_mtim.tv_nsec == 123456789,
           "mtime read back %lld.%09ld, not 1700000000.123456789",
           (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    return 0;
}

static int inotify(void)
{
    char buf[4096] __attribute__((aligned(8)));
    struct pollfd p;
    struct timespec t0, t;
    int in = inotify_init1(IN_NONBLOCK), seen = 0;
    CHECK(in >= 0, "inotify_init1");
    CHECK(inotify_add_watch(in, work, IN_MODIFY | IN_CLOSE_WRITE) >= 0, "inotify_add_watch");
    CHECK(put(at("watched"), "changed") == 0, "write the watched file");
    clock_gettime(CLOCK_MONOTONIC, &t0);
    p = (struct pollfd){.fd = in, .events = POLLIN};
    for (t = t0; !seen && t.tv_sec - t0.tv_sec < 3; clock_gettime(CLOCK_MONOTONIC, &t)) {
        ssize_t n, off;
        if (poll(&p, 1, 200) <= 0)
            continue;
        CHECK((n = read(in, buf, sizeof buf)) > 0 || errno == EAGAIN, "read events");
        for (off = 0; off < n;) {
            struct inotify_event *ev = (struct inotify_event *)(buf + off);
            seen |= ev->len && strcmp(ev->name, "watched") == 0;
            off += sizeof *ev + ev->len;
        }
    }
    close(in);
    EXPECT(seen, "no IN_MODIFY or IN_CLOSE_WRITE for a write in the watched directory "
           "within 3 s");
    return 0;
}

static int hard_link(void)
{
    struct stat st;
    CHECK(put(at("first"), "one") == 0, "create");
    CHECK(link(at("first"), at("second")) == 0, "link");
    CHECK(stat(at("first"), &st) == 0, "stat");
    EXPECT(st.st_nlink == 2, "st_nlink %lu after link, not 2", (unsigned long)st.st_nlink);
    CHECK(put(at("second"), "two") == 0, "write through the link");
    return same_file(at("first"), "two");
}

static int rename_over_open(void)
{
    int fd;
    CHECK(put(at("target"), "old") == 0, "create the target");
    CHECK((fd = open(at("target"), O_RDONLY)) >= 0, "open the target");
    CHECK(put(at("replacement"), "new") == 0, "create the replacement");
    CHECK(rename(at("replacement"), at("target")) == 0, "rename over the open file");
    if (same_at(fd, 0, "old", "read by the old fd"))
        return -1;
    close(fd);
    return same_file(at("target"), "new");
}

static int user_xattr(void)
{
    char got[64] = {0};
    ssize_t n;
    CHECK(put(at("attributed"), "x") == 0, "create");
    CHECK(setxattr(at("attributed"), "user.podvm", "value", 5, 0) == 0, "setxattr user.podvm");
    CHECK((n = getxattr(at("attributed"), "user.podvm", got, sizeof got)) >= 0, "getxattr");
    EXPECT(n == 5 && memcmp(got, "value", 5) == 0, "user.podvm read back \"%.*s\"", (int)n,
           got);
    return 0;
}

static int mmap_shared(void)
{
    char *map, got[6];
    int fd = open(at("mapped"), O_CREAT | O_RDWR, 0644);
    CHECK(fd >= 0, "open");
    CHECK(ftruncate(fd, 4096) == 0, "ftruncate");
    map = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(map != MAP_FAILED, "mmap MAP_SHARED");
    memcpy(map + 100, "mapped", 6);
    CHECK(pread(fd, got, 6, 100) == 6, "read() after a store to the shared map");
    munmap(map, 4096);
    EXPECT(memcmp(got, "mapped", 6) == 0, "read() after a store to the shared map gave "
           "\"%.6s\"", got);
    return close(fd);
}

static int sparse(void)
{
    const off_t mib = 1 << 20;
    off_t data, hole;
    int fd = open(at("sparse"), O_CREAT | O_RDWR, 0644);
    CHECK(fd >= 0, "open");
    CHECK(ftruncate(fd, 4 * mib) == 0, "ftruncate");
    CHECK(pwrite(fd, "data", 4, 2 * mib) == 4, "pwrite in the middle");
    CHECK(fsync(fd) == 0, "fsync");
    CHECK((data = lseek(fd, 0, SEEK_DATA)) >= 0, "SEEK_DATA");
    CHECK((hole = lseek(fd, data, SEEK_HOLE)) >= 0, "SEEK_HOLE");
    EXPECT(data > 0 && data <= 2 * mib && hole > 2 * mib && hole < 4 * mib,
           "SEEK_DATA %lld, SEEK_HOLE %lld: the file reads as not sparse",
           (long long)data, (long long)hole);
    return close(fd);
}

static int preallocate(void)
{
    struct stat st;
    int fd = open(at("allocated"), O_CREAT | O_RDWR, 0644);
    CHECK(fd >= 0, "open");
    CHECK(fallocate(fd, 0, 0, 1 << 20) == 0, "fallocate 1 MiB");
    CHECK(fstat(fd, &st) == 0, "fstat");
    EXPECT(st.st_size == 1 << 20 && (long long)st.st_blocks * 512 >= 1 << 20,
           "after fallocate: size %lld, %lld blocks", (long long)st.st_size,
           (long long)st.st_blocks);
    return close(fd);
}

static int owner_and_mode(void)
{
    struct stat st;
    CHECK(put(at("owned"), "x") == 0, "create");
    CHECK(chown(at("owned"), 1234, 1234) == 0, "chown 1234:1234");
    CHECK(chmod(at("owned"), 04755) == 0, "chmod 04755");
    CHECK(stat(at("owned"), &st) == 0, "stat");
    EXPECT(st.st_uid == 1234 && st.st_gid == 1234 && (st.st_mode & 07777) == 04755,
           "read back %u:%u mode %04o", (unsigned)st.st_uid, (unsigned)st.st_gid,
           (unsigned)(st.st_mode & 07777));
    return 0;
}

static int direct_io(void)
{
    void *buf;
    int fd = open(at("direct"), O_CREAT | O_RDWR | O_DIRECT, 0644), rc;
    CHECK(fd >= 0, "open O_DIRECT");
    CHECK(posix_memalign(&buf, 4096, 4096) == 0, "posix_memalign");
    memset(buf, 'd', 4096);
    CHECK(pwrite(fd, buf, 4096, 0) == 4096, "aligned O_DIRECT write");
    memset(buf, 0, 4096);
    CHECK(pread(fd, buf, 4096, 0) == 4096, "aligned O_DIRECT read");
    rc = ((char *)buf)[4095] == 'd' ? 0 : -1;
    free(buf);
    EXPECT(rc == 0, "O_DIRECT read back other bytes");
    return close(fd);
}

static const struct { const char *name; int (*run)(void); } cases[] = {
    {"unlinked_open", unlinked_open}, {"o_tmpfile", o_tmpfile}, {"unix_socket", unix_socket},
    {"fcntl_lock", record_lock}, {"mkfifo", fifo}, {"mtime_ns", nanosecond_mtime},
    {"inotify", inotify}, {"hard_link", hard_link}, {"rename_over_open", rename_over_open},
    {"xattr_user", user_xattr}, {"flock", whole_file_lock}, {"mmap_shared", mmap_shared},
    {"sparse", sparse}, {"fallocate", preallocate}, {"chown_chmod", owner_and_mode},
    {"odirect", direct_io},
};

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *f)
{
    (void)st, (void)flag, (void)f;
    return remove(path);
}

static int semantics(void)
{
    size_t i;
    int failed = 0;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        errno = 0;
        if (cases[i].run() == 0) {
            printf("ok %s\n", cases[i].name);
        } else {
            printf("FAIL %s: %s\n", cases[i].name, why);
            failed++;
        }
        fflush(stdout);
    }
    return failed ? 1 : 0;
}

static double since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) + (t.tv_nsec - t0->tv_nsec) / 1e9;
}

/* One pass of `op` over n numbered files; its time, or -1 (the error in why). */
static double files(const char *op, long n, const char *block)
{
    struct timespec t0;
    struct stat st;
    char name[32];
    long i;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (i = 0; i < n; i++) {
        snprintf(name, sizeof name, "f%ld", i);
        if (op[0] == 'c') {
            int fd = open(at(name), O_CREAT | O_WRONLY | O_TRUNC, 0644);
            if (fd < 0 || write(fd, block, 4096) != 4096 || close(fd) != 0)
                break;
        } else if (op[0] == 's' ? stat(at(name), &st) : unlink(at(name))) {
            break;
        }
    }
    if (i < n) {
        snprintf(why, sizeof why, "%s f%ld: %s", op, i, strerror(errno));
        return -1;
    }
    return since(&t0);
}

static double big_file(int writing, char *chunk)
{
    struct timespec t0;
    int fd, i;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fd = open(at("big"), writing ? O_CREAT | O_WRONLY | O_TRUNC : O_RDONLY, 0644);
    for (i = 0; fd >= 0 && i < 64; i++)
        if ((writing ? write(fd, chunk, 1 << 20) : read(fd, chunk, 1 << 20)) != 1 << 20)
            break;
    if (fd < 0 || i < 64 || (writing && fsync(fd) != 0) || close(fd) != 0) {
        snprintf(why, sizeof why, "%s 64 MiB: %s", writing ? "write" : "read",
                 strerror(errno));
        return -1;
    }
    return since(&t0);
}

static int speed(long n)
{
    static const char *ops[] = {"create", "stat", "unlink"};
    static char chunk[1 << 20];
    double s;
    int i;
    memset(chunk, 'p', sizeof chunk);
    for (i = 0; i < 3; i++) {
        if ((s = files(ops[i], n, chunk)) < 0)
            return fprintf(stderr, "fsprobe: %s\n", why), 1;
        printf("%s %ld %.6f\n", ops[i], n, s);
    }
    for (i = 1; i >= 0; i--) {
        if ((s = big_file(i, chunk)) < 0)
            return fprintf(stderr, "fsprobe: %s\n", why), 1;
        printf("%s %.6f\n", i ? "write64" : "read64", s);
    }
    return 0;
}

int main(int argc, char **argv)
{
    int rc;
    if (argc < 3 || (strcmp(argv[1], "semantics") && strcmp(argv[1], "speed")) ||
        (argv[1][1] == 'p' && (argc != 4 || atol(argv[3]) < 1))) {
        fprintf(stderr, "usage: fsprobe semantics DIR | fsprobe speed DIR N\n");
        return 2;
    }
    snprintf(work, sizeof work, "%s/fsprobe.XXXXXX", argv[2]);
    if (!mkdtemp(work)) {
        fprintf(stderr, "fsprobe: mkdtemp in %s: %s\n", argv[2], strerror(errno));
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    rc = argv[1][1] == 'p' ? speed(atol(argv[3])) : semantics();
    if (nftw(work, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
        fprintf(stderr, "fsprobe: removing %s: %s\n", work, strerror(errno));
        return rc ? rc : 1;
    }
    return rc;
}
