// ckpt._ckpt: the C++ client (client/include/ckpt/client.h) for Python.
//
// Requests and replies are plain dicts and lists, so the module needs no
// protobuf on the Python side. Failed calls raise ckpt.Error(code, message,
// reason): the gRPC/absl status code name ("NOT_FOUND", ...) and the
// ErrorReason ckptd attached (base/status.h; its ckpt.v1.ErrorReason name
// without the prefix: "QUOTA", "DISK_FULL", ...), or None. Blocking calls
// release the GIL. A host region is exposed through the buffer protocol by a
// Region object that keeps the client (and so the mapping) alive as long as
// anything (a torch tensor made with torch.frombuffer, say) refers to it.
#include <google/protobuf/descriptor.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/export_region.h"
#include "base/status.h"
#include "ckpt/client.h"

namespace py = pybind11;

namespace ckpt {
namespace {

// A failed call, turned into ckpt.Error by the translator below.
struct StatusError : std::runtime_error {
  StatusError(std::string code, const std::string& message, std::optional<std::string> reason)
      : std::runtime_error(message), code(std::move(code)), reason(std::move(reason)) {}
  std::string code;
  std::optional<std::string> reason;  // nullopt: ckptd attached none
};

std::string CodeName(absl::StatusCode code) {
  std::string s = absl::StatusCodeToString(code);
  for (char& c : s) c = c == ' ' ? '_' : static_cast<char>(std::toupper(c));
  return s;
}

static_assert(kErrorReasonCount == v1::ErrorReason_ARRAYSIZE,
              "ErrorReason and ckpt.v1.ErrorReason must list the same reasons");

// The reason attached to `s` as ckpt.v1.ErrorReason names it, without the
// "ERROR_REASON_" prefix ("QUOTA"); nullopt when there is none. The names are
// the wire protocol's, so they stay as they are.
std::optional<std::string> ReasonWireName(const absl::Status& s) {
  const ErrorReason reason = ReasonOf(s);
  if (reason == ErrorReason::kUnspecified) return std::nullopt;
  std::string name = v1::ErrorReason_Name(static_cast<v1::ErrorReason>(reason));
  constexpr absl::string_view kPrefix = "ERROR_REASON_";
  if (absl::StartsWith(name, kPrefix)) name.erase(0, kPrefix.size());
  return name;
}

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError(CodeName(s.code()), std::string(s.message()), ReasonWireName(s));
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  Check(v.status());
  return std::move(v).value();
}

template <typename E>
E EnumFromName(const py::dict& d, const char* key, bool (*parse)(const std::string&, E*),
               const char* prefix, E fallback) {
  if (!d.contains(key)) return fallback;
  const std::string name = absl::StrCat(prefix, py::cast<std::string>(d[key]));
  E e;
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  if (!parse(upper, &e)) throw py::value_error(absl::StrCat("unknown ", key, " '", name, "'"));
  return e;
}

// Every element type a tensor's "dtype" may name, with its bytes per
// element: the API's names (ckpt.v1.DType values are DTYPE_<name>, parsed by
// EnumFromName) and the client's sizes (DTypeBytes, from base/dtype.h's
// table). tests/python/test_dtype_names.py checks ckpt.torch's names of torch
// dtypes against it.
std::map<std::string, uint64_t> DTypeSizes() {
  constexpr std::string_view kPrefix = "DTYPE_";
  std::map<std::string, uint64_t> sizes;
  const google::protobuf::EnumDescriptor* d = v1::DType_descriptor();
  for (int i = 0; i < d->value_count(); ++i) {
    const uint64_t bytes = DTypeBytes(static_cast<v1::DType>(d->value(i)->number()));
    if (bytes == 0) continue;  // DTYPE_UNSPECIFIED
    sizes[d->value(i)->name().substr(kPrefix.size())] = bytes;
  }
  return sizes;
}

template <typename T>
T Get(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? py::cast<T>(d[key]) : fallback;
}

// A key of `d` outside `known` is a typo the daemon would never see: refuse it.
void CheckKeys(const py::dict& d, const char* what, std::initializer_list<const char*> known) {
  for (const auto& item : d) {
    const std::string key = py::cast<std::string>(py::str(item.first));
    bool ok = false;
    for (const char* k : known) ok |= key == k;
    if (!ok) {
      std::string list;
      for (const char* k : known) absl::StrAppend(&list, list.empty() ? "" : ", ", k);
      throw py::value_error(
          absl::StrCat("unknown ", what, " parameter '", key, "' (known: ", list, ")"));
    }
  }
}

v1::PolicySpec PolicyFromDict(const py::dict& p) {
  v1::PolicySpec spec;
  spec.set_kind(EnumFromName(p, "kind", v1::PolicyKind_Parse, "POLICY_", v1::POLICY_ALL));
  spec.set_every_n(Get<uint64_t>(p, "every_n", 0));
  spec.set_optimizer(EnumFromName(p, "optimizer", v1::OptimizerKind_Parse, "OPTIMIZER_",
                                  v1::OPTIMIZER_UNSPECIFIED));
  spec.set_record_trace(Get<bool>(p, "record_trace", false));
  if (p.contains("layercheck")) {
    const py::dict lc = p["layercheck"];
    CheckKeys(lc, "layercheck",
              {"k0", "k0_embedding", "k_floor", "s_max", "warmup", "warmup_interval", "full_every",
               "local_drift", "budget"});
    v1::LayerCheckSpec* l = spec.mutable_layercheck();
    l->set_k0(Get<double>(lc, "k0", 0));
    l->set_k0_embedding(Get<double>(lc, "k0_embedding", 0));
    l->set_k_floor(Get<double>(lc, "k_floor", 0));
    l->set_s_max(Get<uint64_t>(lc, "s_max", 0));
    if (lc.contains("warmup")) l->set_warmup(py::cast<uint64_t>(lc["warmup"]));
    l->set_warmup_interval(Get<uint64_t>(lc, "warmup_interval", 0));
    l->set_full_every(Get<uint64_t>(lc, "full_every", 0));
    l->set_local_drift(Get<bool>(lc, "local_drift", false));
    if (lc.contains("budget") && !lc["budget"].is_none()) {
      const py::dict bd = lc["budget"];
      CheckKeys(bd, "layercheck budget",
                {"bytes_per_step", "bytes_per_s", "share", "step_s", "k_min", "k_max", "horizon",
                 "layer_bytes"});
      v1::WriteBudget* b = l->mutable_budget();
      b->set_bytes_per_step(Get<double>(bd, "bytes_per_step", 0));
      b->set_bytes_per_s(Get<double>(bd, "bytes_per_s", 0));
      b->set_share(Get<double>(bd, "share", 0));
      b->set_step_s(Get<double>(bd, "step_s", 0));
      b->set_k_min(Get<double>(bd, "k_min", 0));
      b->set_k_max(Get<double>(bd, "k_max", 0));
      b->set_horizon(Get<uint64_t>(bd, "horizon", 0));
      for (uint64_t v : Get<std::vector<uint64_t>>(bd, "layer_bytes", {})) b->add_layer_bytes(v);
    }
  }
  return spec;
}

RankSpec SpecFromDict(const py::dict& d) {
  RankSpec spec;
  spec.job_id = py::cast<std::string>(d["job_id"]);
  spec.rank = Get<uint32_t>(d, "rank", 0);
  spec.world_size = Get<uint32_t>(d, "world_size", 1);
  if (d.contains("job_nodes")) spec.job_nodes = py::cast<std::vector<std::string>>(d["job_nodes"]);
  if (d.contains("policy")) spec.policy = PolicyFromDict(d["policy"]);
  for (const py::handle& lh : py::list(d["layers"])) {
    const py::dict l = py::reinterpret_borrow<py::dict>(lh);
    LayerDesc layer;
    layer.name = py::cast<std::string>(l["name"]);
    layer.kind = EnumFromName(l, "kind", v1::LayerKind_Parse, "LAYER_", v1::LAYER_BLOCK);
    layer.frozen = Get<bool>(l, "frozen", false);
    for (const py::handle& th : py::list(l["tensors"])) {
      const py::dict t = py::reinterpret_borrow<py::dict>(th);
      TensorDesc td;
      td.name = py::cast<std::string>(t["name"]);
      td.dtype = EnumFromName(t, "dtype", v1::DType_Parse, "DTYPE_", v1::DTYPE_F32);
      td.shape = py::cast<std::vector<uint64_t>>(t["shape"]);
      td.role = EnumFromName(t, "role", v1::TensorRole_Parse, "ROLE_", v1::ROLE_PARAM);
      td.group = Get<uint32_t>(t, "group", 0);
      td.region = Get<uint32_t>(t, "region", 0);
      td.offset = Get<uint64_t>(t, "offset", 0);
      td.param = Get<std::string>(t, "param", "");
      td.lr_scale = Get<double>(t, "lr_scale", 0);
      td.beta1 = Get<double>(t, "beta1", 0);
      td.beta2 = Get<double>(t, "beta2", 0);
      td.eps = Get<double>(t, "eps", 0);
      td.weight_decay = Get<double>(t, "weight_decay", 0);
      layer.tensors.push_back(std::move(td));
    }
    spec.layers.push_back(std::move(layer));
  }
  return spec;
}

py::dict PlanToDict(const v1::Plan& plan) {
  py::dict d;
  d["job_id"] = plan.job_id();
  d["rank"] = plan.rank();
  d["target_step"] = plan.target_step();
  d["complete"] = plan.complete();
  d["total_bytes"] = plan.total_bytes();
  d["size_weighted_staleness"] = plan.size_weighted_staleness();
  d["max_staleness"] = plan.max_staleness();
  d["aux"] = py::bytes(plan.aux());
  py::list layers;
  for (const v1::LayerPlan& l : plan.layers()) {
    py::dict ld;
    ld["layer"] = l.layer();
    ld["name"] = l.name();
    ld["has_version"] = l.has_version();
    ld["step"] = l.step();
    ld["staleness"] = l.staleness();
    ld["bytes"] = l.bytes();
    ld["source"] = l.source();
    ld["lost_step"] = l.lost_step();
    layers.append(ld);
  }
  d["layers"] = layers;
  return d;
}

// One host region of a client, for the buffer protocol.
struct Region {
  std::shared_ptr<Client> client;
  size_t index;
};

// A destination of ExportInto: a writable, C-contiguous buffer.
struct ExportDest {
  std::string key;  // as the caller wrote it, for errors
  char* ptr;
  uint64_t size;
  bool used = false;
};
// (layer name, tensor name) for a tuple key; ("", name) for a bare one.
using ExportKey = std::pair<std::string, std::string>;

// ExportInto's `dests`, each buffer's info kept in `held` (valid without
// the GIL while it lives).
std::map<ExportKey, ExportDest> ExportDestinations(const py::dict& dests,
                                                   std::vector<py::buffer_info>* held) {
  std::map<ExportKey, ExportDest> out;
  for (const auto& [k, v] : dests) {
    ExportKey key;
    std::string shown;
    if (py::isinstance<py::tuple>(k)) {
      const auto pair = py::cast<std::pair<std::string, std::string>>(k);
      key = pair;
      shown = absl::StrCat("('", pair.first, "', '", pair.second, "')");
    } else {
      key = ExportKey("", py::cast<std::string>(k));
      shown = absl::StrCat("'", key.second, "'");
    }
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(v).request(/*writable=*/true);
    // The bytes are copied to [ptr, ptr + size * itemsize): only a
    // C-contiguous buffer is that range.
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] > 1 && info.strides[d] != expect) {
        throw py::value_error(
            absl::StrCat("the destination of ", shown, " is not a contiguous buffer"));
      }
      expect *= info.shape[d];
    }
    out[key] = ExportDest{shown, static_cast<char*>(info.ptr),
                          static_cast<uint64_t>(info.size * info.itemsize)};
    held->push_back(std::move(info));
  }
  return out;
}

class PyClient {
 public:
  PyClient(const std::string& socket_path, double call_timeout_s, double wait_timeout_s,
           double restore_timeout_s, const std::string& on_daemon_loss,
           double reconnect_interval_s) {
    ClientOptions o;
    o.socket_path = socket_path;
    o.call_timeout = absl::Seconds(call_timeout_s);
    o.wait_timeout = absl::Seconds(wait_timeout_s);
    o.restore_timeout = absl::Seconds(restore_timeout_s);
    o.reconnect_interval = absl::Seconds(reconnect_interval_s);
    if (on_daemon_loss == "continue") {
      o.on_daemon_loss = OnDaemonLoss::kContinueUnprotected;
    } else if (on_daemon_loss != "error") {
      throw py::value_error("on_daemon_loss must be 'error' or 'continue'");
    }
    client_ = std::shared_ptr<Client>(Value(Client::Connect(o)).release());
    on_daemon_loss_ = on_daemon_loss;
  }

  Region AllocateRegion(uint64_t bytes) {
    return Region{client_, Value(client_->AllocateRegion(bytes))};
  }

  py::tuple AddGpuTensor(uint64_t ptr, uint64_t bytes, const std::string& name) {
    const Client::GpuPlace p =
        Value(client_->AddGpuTensor(reinterpret_cast<const void*>(ptr), bytes, name));
    return py::make_tuple(p.region, p.offset);
  }
  void SetCudaStream(uint64_t stream) { client_->SetCudaStream(reinterpret_cast<void*>(stream)); }

  void Register(const py::dict& spec) {
    RankSpec s = SpecFromDict(spec);
    py::gil_scoped_release release;
    Check(client_->Register(s));
  }

  std::string Node() {
    py::gil_scoped_release release;
    return Value(client_->Node());
  }

  void StepDone(uint64_t step, double lr, const py::bytes& aux, const std::vector<uint32_t>& layers,
                const std::vector<std::pair<uint32_t, uint64_t>>& group_steps,
                std::optional<uint64_t> global_durable_step) {
    Client::StepInfo info;
    info.step = step;
    info.global_durable_step = global_durable_step;
    info.lr = lr;
    info.aux = std::string(aux);
    info.layers = layers;
    for (const auto& [group, s] : group_steps) {
      v1::GroupStep g;
      g.set_group(group);
      g.set_step(s);
      info.group_steps.push_back(g);
    }
    py::gil_scoped_release release;
    Check(client_->StepDone(info));
  }

  py::dict WaitSnapshot(uint64_t step) {
    SnapshotInfo info;
    {
      py::gil_scoped_release release;
      info = Value(client_->WaitSnapshot(step));
    }
    py::dict d;
    d["layers"] = info.layers;
    d["skipped"] = info.skipped;
    d["lost"] = info.lost;
    return d;
  }

  // Multi-rank LayerCheck: this rank's per-layer drift sums of `step`, and
  // the all-reduced sums handed back (client.h, ExchangeDrift).
  std::vector<std::pair<double, double>> DriftPartials(uint64_t step) {
    std::vector<LayerSums> sums;
    {
      py::gil_scoped_release release;
      sums = Value(client_->DriftPartials(step));
    }
    std::vector<std::pair<double, double>> out;
    for (const LayerSums& s : sums) out.emplace_back(s.dw2, s.w2);
    return out;
  }
  void SetGlobalDrift(uint64_t step, const std::vector<std::pair<double, double>>& global) {
    std::vector<LayerSums> sums;
    for (const auto& [dw2, w2] : global) sums.push_back(LayerSums{dw2, w2});
    py::gil_scoped_release release;
    Check(client_->SetGlobalDrift(step, sums));
  }

  uint64_t WaitDurable(uint64_t step, const std::string& tier) {
    Client::Tier t = Client::Tier::kLocal;
    if (tier == "remote") {
      t = Client::Tier::kRemote;
    } else if (tier == "peer") {
      t = Client::Tier::kPeer;
    } else if (tier != "local") {
      throw py::value_error("tier must be 'local', 'remote' or 'peer'");
    }
    py::gil_scoped_release release;
    return Value(client_->WaitDurable(step, t));
  }

  py::dict Plan(uint64_t target_step, const std::optional<std::string>& job, uint32_t rank,
                uint64_t older_within) {
    v1::Plan plan;
    {
      py::gil_scoped_release release;
      plan = Value(job.has_value() ? client_->Plan(*job, rank, target_step, older_within)
                                   : client_->Plan(target_step, older_within));
    }
    return PlanToDict(plan);
  }

  // Copies each tensor of `job` rank `rank`'s composite checkpoint into
  // its destination in `dests` (a writable buffer of exactly its size);
  // returns the plan. A destination's key is the tensor's name, or a
  // (layer name, tensor name) tuple; a bare name that two layers of the
  // checkpoint share is refused, naming them, since it could be either.
  // Every tensor of the checkpoint needs exactly one destination and every
  // destination a tensor, or nothing is claimed to be restored.
  py::dict ExportInto(const std::string& job, uint32_t rank, uint64_t target_step,
                      const py::dict& dests, uint64_t older_within) {
    std::vector<py::buffer_info> held;  // keeps every buffer valid without the GIL
    std::map<ExportKey, ExportDest> out = ExportDestinations(dests, &held);
    v1::Plan plan;
    std::map<ExportKey, ExportDest*> placed;  // (layer name, tensor name) -> its destination
    Client::ExportSink sink;
    sink.header = [&](const v1::ExportHeader& h) -> absl::Status {
      plan = h.plan();
      std::map<std::string, std::vector<std::string>> layers_of;  // tensor name -> layers
      for (const v1::ExportTensor& t : h.tensors()) layers_of[t.name()].push_back(t.layer_name());
      for (const v1::ExportTensor& t : h.tensors()) {
        const std::string where = absl::StrCat("tensor '", t.name(), "' of layer '", t.layer_name(),
                                               "' of job ", job, " rank ", rank);
        auto it = out.find(ExportKey(t.layer_name(), t.name()));
        if (it == out.end()) {
          it = out.find(ExportKey("", t.name()));
          if (it != out.end() && layers_of[t.name()].size() > 1) {
            return absl::FailedPreconditionError(
                absl::StrCat("tensor name '", t.name(), "' is in layers '",
                             absl::StrJoin(layers_of[t.name()], "', '"), "' of job ", job, " rank ",
                             rank, ": key its destinations by (layer name, tensor name)"));
          }
        }
        if (it == out.end()) {
          return absl::FailedPreconditionError(absl::StrCat(where, " has no place in this model"));
        }
        if (it->second.used) {
          return absl::FailedPreconditionError(
              absl::StrCat("the destination ", it->second.key, " is named by two tensors"));
        }
        if (it->second.size != t.nbytes()) {
          return absl::FailedPreconditionError(absl::StrCat(where, " has ", t.nbytes(),
                                                            " bytes in the checkpoint and ",
                                                            it->second.size, " in this model"));
        }
        it->second.used = true;
        placed[ExportKey(t.layer_name(), t.name())] = &it->second;
      }
      for (const auto& [key, d] : out) {
        if (!d.used) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the destination ", d.key, " is not in job ", job, " rank ", rank, "'s checkpoint"));
        }
      }
      return absl::OkStatus();
    };
    sink.data = [&](const v1::ExportTensor& t, uint64_t offset,
                    std::string_view piece) -> absl::Status {
      auto it = placed.find(ExportKey(t.layer_name(), t.name()));
      if (it == placed.end() || offset > it->second->size ||
          piece.size() > it->second->size - offset) {
        return absl::DataLossError(absl::StrCat("ckptd sent bytes of tensor '", t.name(),
                                                "' of layer '", t.layer_name(),
                                                "' outside its destination"));
      }
      std::memcpy(it->second->ptr + offset, piece.data(), piece.size());
      return absl::OkStatus();
    };
    // The bytes come through a shared window (Client::ExportSink): no
    // larger than the bytes due (every tensor needs a destination of its
    // size), nor than kExportRegionWindowBytes unless a tensor is larger.
    uint64_t due = 0, largest = 0;
    for (const auto& [key, d] : out) {
      due += d.size;
      largest = std::max(largest, d.size);
    }
    sink.region_bytes = std::min(due, std::max(kExportRegionWindowBytes, 2 * largest));
    {
      py::gil_scoped_release release;
      Check(client_->Export(job, rank, target_step, sink, older_within));
    }
    return PlanToDict(plan);
  }

  py::dict Restore(uint64_t target_step, bool discard_later, uint64_t older_within) {
    v1::RestoreReply reply;
    {
      py::gil_scoped_release release;
      reply = Value(client_->Restore(target_step, discard_later, older_within));
    }
    py::dict d = PlanToDict(reply.plan());
    d["bytes_restored"] = reply.bytes_restored();
    d["seconds"] = reply.seconds();
    return d;
  }

  void Unregister(bool drain) {
    py::gil_scoped_release release;
    Check(client_->Unregister(drain));
  }

  uint64_t generation() const { return client_->generation(); }
  uint64_t latest_durable_step_at_register() const {
    return client_->latest_durable_step_at_register();
  }
  bool unprotected() const { return client_->unprotected(); }
  const std::string& on_daemon_loss() const { return on_daemon_loss_; }

 private:
  std::shared_ptr<Client> client_;
  std::string on_daemon_loss_;  // "error" or "continue"
};

}  // namespace
}  // namespace ckpt

PYBIND11_MODULE(_ckpt, m) {
  using ckpt::PyClient;
  using ckpt::Region;
  m.doc() = "ckptd client (see ckpt/__init__.py)";
  // The project's version (CMake's project VERSION), as ckptd's Status reports it.
  m.attr("__version__") = CKPT_VERSION;
  m.def("dtype_sizes", &ckpt::DTypeSizes,
        "{name: bytes per element} of every dtype a tensor spec may name");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ckpt::StatusError& e) {
      py::object reason = e.reason.has_value() ? py::object(py::str(*e.reason)) : py::none();
      py::object error = py::module_::import("ckpt").attr("Error")(e.code, e.what(), reason);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
  py::class_<Region>(m, "Region", py::buffer_protocol())
      .def_property_readonly("index", [](const Region& r) { return r.index; })
      .def_property_readonly("size", [](const Region& r) { return r.client->RegionSize(r.index); })
      .def_buffer([](Region& r) {
        return py::buffer_info(r.client->RegionData(r.index), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.client->RegionSize(r.index))}, {1},
                               /*readonly=*/false);
      });
  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, double, double, double, const std::string&, double>(),
           py::arg("socket_path") = "/run/ckptd/ckptd.sock", py::arg("call_timeout_s") = 10.0,
           py::arg("wait_timeout_s") = 120.0, py::arg("restore_timeout_s") = 1800.0,
           py::arg("on_daemon_loss") = "error", py::arg("reconnect_interval_s") = 2.0)
      .def("allocate_region", &PyClient::AllocateRegion, py::arg("bytes"))
      .def("add_gpu_tensor", &PyClient::AddGpuTensor, py::arg("ptr"), py::arg("bytes"),
           py::arg("name"))
      .def("set_cuda_stream", &PyClient::SetCudaStream, py::arg("stream"))
      .def("register", &PyClient::Register, py::arg("spec"))
      .def("node", &PyClient::Node)
      .def("step_done", &PyClient::StepDone, py::arg("step"), py::arg("lr"),
           py::arg("aux") = py::bytes(), py::arg("layers") = std::vector<uint32_t>{},
           py::arg("group_steps") = std::vector<std::pair<uint32_t, uint64_t>>{},
           py::arg("global_durable_step") = py::none())
      .def("wait_snapshot", &PyClient::WaitSnapshot, py::arg("step"))
      .def("wait_durable", &PyClient::WaitDurable, py::arg("step"), py::arg("tier") = "local")
      .def("drift_partials", &PyClient::DriftPartials, py::arg("step"))
      .def("set_global_drift", &PyClient::SetGlobalDrift, py::arg("step"), py::arg("sums"))
      .def("export_into", &PyClient::ExportInto, py::arg("job_id"), py::arg("rank"),
           py::arg("target_step"), py::arg("dests"), py::arg("older_within") = 0)
      .def("plan", &PyClient::Plan, py::arg("target_step") = 0, py::arg("job_id") = py::none(),
           py::arg("rank") = 0, py::arg("older_within") = 0)
      .def("restore", &PyClient::Restore, py::arg("target_step") = 0,
           py::arg("discard_later") = false, py::arg("older_within") = 0)
      .def("unregister", &PyClient::Unregister, py::arg("drain") = true)
      .def_property_readonly("generation", &PyClient::generation)
      .def_property_readonly("latest_durable_step_at_register",
                             &PyClient::latest_durable_step_at_register)
      .def_property_readonly("unprotected", &PyClient::unprotected)
      .def_property_readonly("on_daemon_loss", &PyClient::on_daemon_loss);
}
