// Kill points: named places in the commit protocol where a crash test can
// make the daemon die with SIGKILL (RocksDB's TEST_KILL_RANDOM idea). Delay
// points: named places where the daemon can be made to sleep.
//
// Compiled in when CKPT_KILL_POINTS is defined (the default build); inert
// unless the environment sets one of:
//   CKPT_KILL_AT=<name>[:<n>]   die at the n-th (default 1st) hit of <name>
//   CKPT_KILL_ODDS=<k>          die at each hit with probability 1/k
//   CKPT_KILL_SEED=<seed>       seed for the odds (default: time)
//   CKPT_KILL_LOG=<path>        append each hit's name (one line) before dying
//   CKPT_DELAY_AT=<name>:<ms>[:<n>]   sleep <ms> at every hit of the delay
//                               point <name>, or only at its n-th hit (to widen
//                               a race by hand against a real ckptd; the tests
//                               order races with sync points)
//   CKPT_DELAY_LOG=<path>       append the delay point's name (one line) at
//                               each hit it sleeps at, before sleeping
//   CKPT_CANCEL_AT=<name>:<n>   the n-th hit of the cancel point <name> says
//                               "cancel": a gRPC handler there cancels its
//                               call as the runtime does when ckptd stops
//                               mid-call (the client sees gRPC's own status)
//   CKPT_DELAY_UNTIL=<path>     a delay ends early once <path> exists; with
//                               the log, a test holds a real ckptd at a point
//                               (it sees the line) and releases it (creates
//                               the file) instead of sleeping; <ms> stays the
//                               deadline
// The cost when inert is one relaxed atomic load.
//
// Every kill point and every delay point is also a sync point of the same
// name (sync_point.h): a test running the engine in its own process can make
// a thread wait there, or run a callback there, without the environment. The
// sync point is processed first, then the kill or the delay.
#pragma once

#include "daemon/common/sync_point.h"

namespace ckpt {

// Reads the environment once; called by main() (and lazily otherwise).
void InitKillPoints();
void KillPointHit(const char* name);
void DelayPointHit(const char* name);
bool CancelPointHit(const char* name);
bool KillPointsArmed();

}  // namespace ckpt

#ifdef CKPT_KILL_POINTS
#define CKPT_DELAY_POINT(name)                                  \
  do {                                                          \
    CKPT_SYNC_POINT(name);                                      \
    if (::ckpt::KillPointsArmed()) ::ckpt::DelayPointHit(name); \
  } while (0)
#define CKPT_KILL_POINT(name)                                  \
  do {                                                         \
    CKPT_SYNC_POINT(name);                                     \
    if (::ckpt::KillPointsArmed()) ::ckpt::KillPointHit(name); \
  } while (0)
// True at the hit CKPT_CANCEL_AT names.
#define CKPT_CANCEL_POINT(name) (::ckpt::KillPointsArmed() && ::ckpt::CancelPointHit(name))
#else
#define CKPT_CANCEL_POINT(name) false
#define CKPT_DELAY_POINT(name) \
  do {                         \
  } while (0)
#define CKPT_KILL_POINT(name) \
  do {                        \
  } while (0)
#endif
