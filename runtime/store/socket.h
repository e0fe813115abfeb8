#pragma once
// POSIX TCP sockets for the rendezvous store, bounded by deadlines.
// Every socket here is non-blocking; every wait polls against a Deadline.
// This file (socket.cc) is the one place where a socket errno becomes an
// exception: raiseSocketError turns ETIMEDOUT into TimeoutError and anything
// else into CommError, naming the endpoint and what to do next.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/deadline.h"
#include "runtime/fd.h"

namespace bulkhead::net {

// "127.0.0.1:29500", "[::1]:29500".
std::string formatEndpoint(const std::string& host, uint16_t port);

// The one conversion of a socket errno: TimeoutError for ETIMEDOUT, CommError
// otherwise. `what` says what was attempted, e.g. "connect to 127.0.0.1:29500";
// `advice` what to do next (empty: check that the store server still runs).
[[noreturn]] void raiseSocketError(const std::string& what, int error, std::string_view advice = {});

// Sets O_NONBLOCK (and FD_CLOEXEC); raises through raiseSocketError.
void makeNonBlocking(int fd);

// A non-blocking socket bound to host:port and listening. Port 0 picks a free
// port (read it with localPort). CommError when the address cannot be bound.
Fd listenOn(const std::string& host, uint16_t port, int backlog);
uint16_t localPort(int fd);

// Polls `fd` for `events` (POLLIN/POLLOUT) until ready or the deadline passes.
// Returns false when the deadline passed first. Error and hang-up conditions
// count as ready: the next read or write reports them.
bool waitReady(int fd, short events, Deadline deadline);

enum class ConnectResult { Connected, Refused, DeadlinePassed };

// One attempt to connect a non-blocking TCP socket to host:port (every
// address host resolves to, in order). `lastError` receives the errno of the
// last failure, for messages. Refused means no one listens there (yet): the
// caller may retry while its deadline allows. Name resolution uses the system
// resolver, which the deadline does not bound; pass numeric addresses where
// that matters.
ConnectResult connectOnce(const std::string& host, uint16_t port, Deadline deadline, Fd& connected, int& lastError);

// Sends every byte before the deadline. Returns false when the deadline passed
// first (part of the bytes may have been sent); raises CommError when the
// connection fails. Never raises SIGPIPE.
bool sendAll(int fd, std::string_view bytes, Deadline deadline, const std::string& peer);

// Receives exactly `size` bytes before the deadline. Returns false when the
// deadline passed first; raises CommError when the peer closed the
// connection or it failed.
bool receiveExactly(int fd, char* buffer, size_t size, Deadline deadline, const std::string& peer);

// The non-blocking primitives the server's poll loop uses. They return the
// byte count, 0 when the call would block, or -1 with `error` set (the peer
// closed the connection: error = 0).
long sendSome(int fd, std::string_view bytes, int& error);
long receiveSome(int fd, char* buffer, size_t capacity, int& error);

// errno's text, for log lines.
std::string errorText(int error);

// "host:port" of the connected peer of `fd`, numeric ("?" when unknown).
std::string peerName(int fd);

// Raises this process's soft limit on open descriptors to the hard one, as far
// as the system allows (a store server holds a connection per rank).
void raiseDescriptorLimit();

}  // namespace bulkhead::net
