// Holding: a share of a bounded resource that is given back when the object
// is destroyed, so its owner can keep it exactly as long as what it stands
// for (the handover's count of a registration's descriptors, kept by the
// registration's memory until that is released).
//
// Thread-safety: an implementation gives its share back from its destructor,
// on whichever thread destroys it.
#pragma once

namespace ckpt {

class Holding {
 public:
  virtual ~Holding() = default;
};

}  // namespace ckpt
