// Comm: MPI point-to-point with bounded waits. Two duplicated communicators keep the heartbeats
// apart from the data: a data receive never sees a heartbeat, and a slow data transfer never delays
// one. Waiting threads poll: they spin for a short while (a hand-off that is about to arrive costs
// no sleep), then yield for up to 20 ms (one stage step; a sleeping receiver would stall the
// fragments of a large message), then sleep in 200 µs steps, so a rank waiting for long leaves the
// cores to the ranks that compute.
#include "runtime/mpi_comm.h"

#if BATON_HAVE_MPI

// The C API only: Open MPI's (deprecated) C++ bindings would need libmpi_cxx at link time.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

namespace baton::mpi {

namespace {
using Clock = std::chrono::steady_clock;
constexpr int kBeatTag = 99;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, size_t(len));
}

// Waits a little: spinning at first, then sleeping, by how long the caller has waited so far.
void backoff(Clock::time_point since) {
  const auto waited = Clock::now() - since;
  if (waited < std::chrono::microseconds(100)) return;
  // Yield (not sleep) for the length of a typical stage step: a large message arrives in fragments
  // that only move while both sides poll, so a sleeping receiver stretches every hand-off.
  if (waited < std::chrono::milliseconds(20)) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(200));
}
}  // namespace

struct Outgoing {
  std::vector<uint8_t> bytes;
  MPI_Request req = MPI_REQUEST_NULL;
  int dest = 0;
};

struct Comm::Impl {
  MPI_Comm data = MPI_COMM_NULL, beat = MPI_COMM_NULL, bulk = MPI_COMM_NULL;
  std::mutex send_mu;             // guards `out`
  std::deque<Outgoing> out;       // sends MPI still holds
  std::mutex recv_mu;             // one receiver at a time (probe + receive must pair up)
  std::thread beater;
  std::atomic<bool> stop{false};
  mutable std::mutex fail_mu;
  std::string failure;            // first lost peer
  std::atomic<bool> failed{false};

  void set_failure(const std::string& why) {
    std::lock_guard<std::mutex> lock(fail_mu);
    if (failure.empty()) failure = why;
    failed = true;
  }
};

static Comm* g_comm = nullptr;

Comm* Comm::get() { return g_comm; }

Comm& Comm::init() {
  if (g_comm) return *g_comm;
  int provided = 0;
  int is_init = 0;
  MPI_Initialized(&is_init);
  if (!is_init) MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  else MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE)
    fail(ErrorKind::Usage, "this MPI library does not support MPI_THREAD_MULTIPLE (got level {}); "
         "the distributed pipeline needs it", provided);
  auto* c = new Comm();
  c->impl_ = new Impl();
  MPI_Comm_rank(MPI_COMM_WORLD, &c->rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &c->size_);
  char host[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(host, &len);
  c->host_ = std::string(host, size_t(len));
  if (const char* t = std::getenv("BATON_MPI_TIMEOUT")) {
    char* end = nullptr;
    const double v = std::strtod(t, &end);
    if (end == t || *end != '\0' || !(v > 0))
      fail(ErrorKind::Usage, "BATON_MPI_TIMEOUT='{}': expected a positive number of seconds", t);
    c->timeout_s_ = v;
  }
  Impl& im = *c->impl_;
  MPI_Comm_dup(MPI_COMM_WORLD, &im.data);
  MPI_Comm_dup(MPI_COMM_WORLD, &im.beat);
  MPI_Comm_dup(MPI_COMM_WORLD, &im.bulk);
  // Errors come back as codes (and become Errors naming the peer) instead of killing the job.
  MPI_Comm_set_errhandler(im.data, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(im.beat, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(im.bulk, MPI_ERRORS_RETURN);
  g_comm = c;

  // Heartbeats: every rank beats every other rank several times per timeout and watches what it
  // hears back. A killed rank is usually reported by the launcher first (it ends the job); a rank
  // that is stopped or stuck outside our threads is found here.
  const int size = c->size_, rank = c->rank_;
  const double timeout = c->timeout_s_;
  im.beater = std::thread([&im, size, rank, timeout] {
    const auto period = std::chrono::duration<double>(std::min(1.0, std::max(0.05, timeout / 10)));
    std::vector<Clock::time_point> heard(size_t(size), Clock::now());
    std::deque<MPI_Request> pending;
    const uint8_t one = 1;
    auto next_beat = Clock::now();
    while (!im.stop.load()) {
      const auto now = Clock::now();
      if (now >= next_beat) {
        for (int r = 0; r < size; ++r) {
          if (r == rank) continue;
          MPI_Request q;
          if (MPI_Isend(&one, 1, MPI_BYTE, r, kBeatTag, im.beat, &q) == MPI_SUCCESS) pending.push_back(q);
        }
        next_beat = now + std::chrono::duration_cast<Clock::duration>(period);
      }
      while (!pending.empty()) {  // beats to a silent rank stay pending; that is fine
        int done = 0;
        MPI_Test(&pending.front(), &done, MPI_STATUS_IGNORE);
        if (!done) break;
        pending.pop_front();
      }
      for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, kBeatTag, im.beat, &flag, &st) != MPI_SUCCESS || !flag) break;
        uint8_t b = 0;
        MPI_Recv(&b, 1, MPI_BYTE, st.MPI_SOURCE, kBeatTag, im.beat, MPI_STATUS_IGNORE);
        heard[size_t(st.MPI_SOURCE)] = Clock::now();
      }
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        const double silent = std::chrono::duration<double>(Clock::now() - heard[size_t(r)]).count();
        if (silent > timeout && !im.failed.load())
          im.set_failure(fmt::format("rank {} stopped answering (no heartbeat for {:.1f} s; BATON_MPI_TIMEOUT={})",
                                     r, silent, timeout));
      }
      // Every millisecond: the probe above also drives MPI's progress engine, so a large send
      // (rendezvous over TCP) moves on while this rank's other threads compute.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (auto& q : pending) MPI_Request_free(&q);
  });
  return *c;
}

std::string Comm::failure() const {
  std::lock_guard<std::mutex> lock(impl_->fail_mu);
  return impl_->failure;
}

void Comm::throw_if_failed() const {
  if (impl_->failed.load()) fail(ErrorKind::Model, "{}", failure());
}

void Comm::send(int dest, int tag, std::vector<uint8_t> bytes) { send_on(&impl_->data, dest, tag, std::move(bytes)); }
void Comm::send_bulk(int dest, std::vector<uint8_t> bytes) { send_on(&impl_->bulk, dest, 0, std::move(bytes)); }

void Comm::send_on(void* comm, int dest, int tag, std::vector<uint8_t> bytes) {
  if (bytes.size() > size_t(INT32_MAX))
    fail(ErrorKind::Usage, "a message of {} bytes to rank {} is larger than MPI's 2 GiB limit "
         "(use a smaller --batch-size)", bytes.size(), dest);
  throw_if_failed();
  std::lock_guard<std::mutex> lock(impl_->send_mu);
  impl_->out.push_back({std::move(bytes), MPI_REQUEST_NULL, dest});
  Outgoing& o = impl_->out.back();
  const int rc = MPI_Isend(o.bytes.data(), int(o.bytes.size()), MPI_BYTE, dest, tag, *static_cast<MPI_Comm*>(comm), &o.req);
  if (rc != MPI_SUCCESS) {
    impl_->out.pop_back();
    fail(ErrorKind::Model, "sending to rank {} failed: {}", dest, mpi_error_text(rc));
  }
}

void Comm::poll_sends() {
  std::lock_guard<std::mutex> lock(impl_->send_mu);
  auto& out = impl_->out;
  for (auto it = out.begin(); it != out.end();) {
    int done = 0;
    MPI_Status st;
    const int rc = MPI_Test(&it->req, &done, &st);
    if (rc != MPI_SUCCESS) fail(ErrorKind::Model, "sending to rank {} failed: {}", it->dest, mpi_error_text(rc));
    it = done ? out.erase(it) : std::next(it);
  }
}

void Comm::flush() {
  const auto t0 = Clock::now();
  for (;;) {
    poll_sends();
    {
      std::lock_guard<std::mutex> lock(impl_->send_mu);
      if (impl_->out.empty()) return;
    }
    throw_if_failed();
    backoff(t0);
  }
}

Message Comm::recv(int source) { return *recv_until({}, source); }

std::optional<Message> Comm::recv_until(const std::function<bool()>& done, int source, int tag) {
  std::lock_guard<std::mutex> lock(impl_->recv_mu);
  const auto t0 = Clock::now();
  for (;;) {
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Iprobe(source < 0 ? MPI_ANY_SOURCE : source, tag < 0 ? MPI_ANY_TAG : tag, impl_->data, &flag, &st);
    if (rc != MPI_SUCCESS) fail(ErrorKind::Model, "waiting for rank {} failed: {}", source, mpi_error_text(rc));
    if (flag) {
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      Message m;
      m.source = st.MPI_SOURCE;
      m.tag = st.MPI_TAG;
      m.bytes.resize(size_t(count));
      rc = MPI_Recv(m.bytes.data(), count, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, impl_->data, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS)
        fail(ErrorKind::Model, "receiving from rank {} failed: {}", st.MPI_SOURCE, mpi_error_text(rc));
      return m;
    }
    throw_if_failed();
    if (done && done()) return std::nullopt;
    poll_sends();  // our own sends progress while we wait
    backoff(t0);
  }
}

void Comm::recv_into(int source, int tag, void* dst, size_t bytes) {
  recv_into_on(&impl_->data, source, tag, dst, bytes, {});
}

bool Comm::recv_bulk_into(int source, void* dst, size_t bytes, const std::function<bool()>& stop) {
  return recv_into_on(&impl_->bulk, source, 0, dst, bytes, stop);
}

int Comm::pending(int source, int tag) {
  int flag = 0;
  MPI_Status st;
  const int rc = MPI_Iprobe(source < 0 ? MPI_ANY_SOURCE : source, tag, impl_->data, &flag, &st);
  if (rc != MPI_SUCCESS) fail(ErrorKind::Model, "polling rank {} failed: {}", source, mpi_error_text(rc));
  return flag ? st.MPI_SOURCE : -1;
}

bool Comm::recv_into_on(void* comm_ptr, int source, int tag, void* dst, size_t bytes, const std::function<bool()>& stop) {
  if (bytes > size_t(INT32_MAX))
    fail(ErrorKind::Usage, "a message of {} bytes from rank {} is larger than MPI's 2 GiB limit", bytes, source);
  const MPI_Comm comm = *static_cast<MPI_Comm*>(comm_ptr);
  // The data lane has one receiver at a time (probe + receive must pair up); the bulk lane has
  // one receiving thread per rank (the stage's).
  std::unique_lock<std::mutex> lock(impl_->recv_mu, std::defer_lock);
  if (comm == impl_->data) lock.lock();
  const auto t0 = Clock::now();
  for (;;) {
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Iprobe(source, tag, comm, &flag, &st);
    if (rc != MPI_SUCCESS) fail(ErrorKind::Model, "waiting for rank {} failed: {}", source, mpi_error_text(rc));
    if (flag) {
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      if (size_t(count) != bytes)
        fail(ErrorKind::Model, "rank {} sent {} bytes where {} were expected (different baton versions on the ranks?)",
             source, count, bytes);
      rc = MPI_Recv(dst, count, MPI_BYTE, source, tag, comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) fail(ErrorKind::Model, "receiving from rank {} failed: {}", source, mpi_error_text(rc));
      return true;
    }
    throw_if_failed();
    if (stop && stop()) return false;
    poll_sends();
    backoff(t0);
  }
}

void Comm::finalize() {
  if (finalized_) return;
  impl_->stop = true;
  if (impl_->beater.joinable()) impl_->beater.join();
  {
    std::lock_guard<std::mutex> lock(impl_->send_mu);
    for (auto& o : impl_->out) MPI_Request_free(&o.req);
    impl_->out.clear();
  }
  // Everyone reaches this point together (every peer has stopped beating once the barrier
  // passes); the beats still addressed to us are drained so finalize finds no unmatched messages.
  MPI_Barrier(MPI_COMM_WORLD);
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kBeatTag, impl_->beat, &flag, &st) != MPI_SUCCESS || !flag) break;
    uint8_t b = 0;
    MPI_Recv(&b, 1, MPI_BYTE, st.MPI_SOURCE, kBeatTag, impl_->beat, MPI_STATUS_IGNORE);
  }
  MPI_Comm_free(&impl_->data);
  MPI_Comm_free(&impl_->beat);
  MPI_Comm_free(&impl_->bulk);
  MPI_Finalize();
  finalized_ = true;
}

void Comm::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // not reached: MPI_Abort ends the process
}

}  // namespace baton::mpi

#endif  // BATON_HAVE_MPI
