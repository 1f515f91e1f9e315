/* Files in directories other users can write (/dev/shm, /tmp): made and
 * read so that no other user can point them elsewhere, swap them for a
 * FIFO, or crash a reader by truncating them (src/shmfile.c). The trust
 * model is in docs/security.md. */
#ifndef GPUMEM_SHMFILE_H
#define GPUMEM_SHMFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>

/* Creates path afresh: O_CREAT|O_EXCL|O_NOFOLLOW (never through a link,
 * never an existing file), mode exactly (umask aside), checked with fstat
 * to be a regular file of this user. Returns the descriptor (O_RDWR,
 * O_CLOEXEC) or -1 with errno set (EEXIST when the name is taken). */
int gm_shm_create_at(int dir_fd, const char* name, mode_t mode);

/* Opens an existing file to read without trusting it: O_NOFOLLOW (a link
 * is refused), O_NONBLOCK (a FIFO cannot block), then fstat: a regular
 * file of want_size bytes (0: any size) owned by a user this process may
 * trust (itself; root trusts every owner). Returns the descriptor or -1. */
int gm_shm_open_read(const char* path, size_t want_size, struct stat* st);

/* Whether a file owned by uid may be believed by this process: its own
 * files, and every file when it runs as root (which reads them all). */
bool gm_shm_owner_trusted(uid_t uid);

/* Liveness by lock: a process holds a write lock (an open-file-description
 * lock, F_OFD_SETLK) on one byte of a file for its life; the kernel drops
 * it when the process dies, whatever pid namespace either side is in.
 * gm_life_lock takes it without waiting (false: another holds it);
 * gm_life_lock_held tests it through any descriptor of the file, of any
 * open mode (false when nobody else holds it, or on error). */
bool gm_life_lock(int fd, off_t byte);
bool gm_life_lock_held(int fd, off_t byte);
/* Waits for, then drops, an exclusive lock on bytes [byte, byte+len). */
bool gm_range_lock(int fd, off_t byte, off_t len);
void gm_range_unlock(int fd, off_t byte, off_t len);

/* A descriptor holding life locks must not stay open in a forked child
 * (the lock would outlive its holder there): registered descriptors are
 * closed in every child fork() makes. Unregister before closing it. */
void gm_life_fd_register(int fd);
void gm_life_fd_unregister(int fd);

/* The pread of exactly n bytes at off (retried when interrupted): false
 * when the file holds fewer, as a file truncated under its reader does. */
bool gm_pread_all(int fd, void* buf, size_t n, off_t off);
bool gm_pwrite_all(int fd, const void* buf, size_t n, off_t off);

#endif
