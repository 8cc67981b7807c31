/* What SQLite does to a file system, timed: a database in DIR, ROWS inserts each in its
 * own transaction (each a journal written, synced and removed, the database locked with
 * fcntl and synced), then ROWS more in one transaction, then a reader in another
 * process while a writer holds the database (SQLITE_BUSY is the right answer, not a
 * hang nor an error of the lock itself), and after. Built static against Debian's libsqlite3.a, so
 * that the busybox image can run it (tests/e2e/test_file_semantics.py,
 * bench/fs_bench.py).
 *
 * usage: sqliteprobe DIR ROWS
 * prints: "sqlite each <seconds>", "sqlite batch <seconds>", "sqlite rows <count>",
 * "sqlite busy ok", then "sqlite ok"; exit 1 with what failed on stderr. The database
 * and its journal are removed at the end. */
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int fail(sqlite3 *db, const char *what) {
    fprintf(stderr, "sqliteprobe: %s: %s\n", what, db ? sqlite3_errmsg(db) : "open");
    return 1;
}

static int exec(sqlite3 *db, const char *sql) {
    char *err = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &err) != SQLITE_OK) {
        fprintf(stderr, "sqliteprobe: %s: %s\n", sql, err ? err : "?");
        sqlite3_free(err);
        return 1;
    }
    return 0;
}

static int insert(sqlite3 *db, sqlite3_stmt *stmt, int i) {
    sqlite3_bind_int(stmt, 1, i);
    sqlite3_bind_text(stmt, 2, "a row of the kind an application keeps", -1, SQLITE_STATIC);
    int rc = sqlite3_step(stmt);
    sqlite3_reset(stmt);
    return rc == SQLITE_DONE ? 0 : fail(db, "insert");
}

/* What a SELECT in a new process says of the database: its sqlite3_exec code. */
static int reader_in_child(const char *path) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        sqlite3 *reader = NULL;
        if (sqlite3_open(path, &reader) != SQLITE_OK)
            _exit(100);
        _exit(sqlite3_exec(reader, "SELECT count(*) FROM t", NULL, NULL, NULL));
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return -1;
    return WEXITSTATUS(status);
}

int main(int argc, char **argv) {
    if (argc != 3 || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: sqliteprobe DIR ROWS\n");
        return 2;
    }
    int rows = atoi(argv[2]);
    char path[4096], journal[4200];
    snprintf(path, sizeof path, "%s/sqliteprobe.db", argv[1]);
    snprintf(journal, sizeof journal, "%s-journal", path);
    unlink(path);
    sqlite3 *db = NULL;
    sqlite3_stmt *stmt = NULL;
    if (sqlite3_open(path, &db) != SQLITE_OK)
        return fail(db, "open");
    if (exec(db, "PRAGMA synchronous=FULL") ||
        exec(db, "CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT)"))
        return 1;
    if (sqlite3_prepare_v2(db, "INSERT INTO t VALUES (?, ?)", -1, &stmt, NULL) != SQLITE_OK)
        return fail(db, "prepare");
    double t0 = now();
    for (int i = 0; i < rows; i++)
        if (insert(db, stmt, i))
            return 1;
    double t1 = now();
    if (exec(db, "BEGIN"))
        return 1;
    for (int i = rows; i < 2 * rows; i++)
        if (insert(db, stmt, i))
            return 1;
    if (exec(db, "COMMIT"))
        return 1;
    double t2 = now();
    sqlite3_finalize(stmt);
    printf("sqlite each %.6f\nsqlite batch %.6f\n", t1 - t0, t2 - t1);
    if (sqlite3_prepare_v2(db, "SELECT count(*) FROM t", -1, &stmt, NULL) != SQLITE_OK ||
        sqlite3_step(stmt) != SQLITE_ROW)
        return fail(db, "count");
    printf("sqlite rows %d\n", sqlite3_column_int(stmt, 0));
    sqlite3_finalize(stmt);
    /* A writer holds the database (an exclusive lock: fcntl on the file); another
     * process is refused with SQLITE_BUSY, and reads once it is let go. Another process:
     * fcntl locks are a process's, and SQLite sorts out its own connections itself. */
    if (exec(db, "BEGIN EXCLUSIVE"))
        return 1;
    if (reader_in_child(path) != SQLITE_BUSY) {
        fprintf(stderr, "sqliteprobe: another process read beside an exclusive writer\n");
        return 1;
    }
    if (exec(db, "COMMIT"))
        return 1;
    if (reader_in_child(path) != SQLITE_OK) {
        fprintf(stderr, "sqliteprobe: another process could not read after the commit\n");
        return 1;
    }
    printf("sqlite busy ok\n");
    sqlite3_close(db);
    unlink(path);
    unlink(journal);
    printf("sqlite ok\n");
    return 0;
}
