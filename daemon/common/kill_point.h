// Kill points: named places in the commit protocol where a crash test can
// make the daemon die with SIGKILL (RocksDB's TEST_KILL_RANDOM idea).
//
// Compiled in when CKPT_KILL_POINTS is defined (the default build); inert
// unless the environment sets one of:
//   CKPT_KILL_AT=<name>[:<n>]   die at the n-th (default 1st) hit of <name>
//   CKPT_KILL_ODDS=<k>          die at each hit with probability 1/k
//   CKPT_KILL_SEED=<seed>       seed for the odds (default: time)
//   CKPT_KILL_LOG=<path>        append each hit's name (one line) before dying
//   CKPT_DELAY_AT=<name>:<ms>   sleep <ms> at every hit of <name> (tests use it
//                               to hold writers and fill the staging pool)
// The cost when inert is one relaxed atomic load.
#pragma once

namespace ckpt {

// Reads the environment once; called by main() (and lazily otherwise).
void InitKillPoints();
void KillPointHit(const char* name);
void DelayPointHit(const char* name);
bool KillPointsArmed();

}  // namespace ckpt

#ifdef CKPT_KILL_POINTS
#define CKPT_DELAY_POINT(name)                                  \
  do {                                                          \
    if (::ckpt::KillPointsArmed()) ::ckpt::DelayPointHit(name); \
  } while (0)
#define CKPT_KILL_POINT(name)                            \
  do {                                                   \
    if (::ckpt::KillPointsArmed()) ::ckpt::KillPointHit(name); \
  } while (0)
#else
#define CKPT_DELAY_POINT(name) \
  do {                         \
  } while (0)
#define CKPT_KILL_POINT(name) \
  do {                        \
  } while (0)
#endif
