// Command cas-netpol enforces Kubernetes NetworkPolicies on the local stack's pod network with
// the policy engine of kube-network-policies (sigs.k8s.io/kube-network-policies, the
// reference implementation kind uses; built unmodified from its module by
// e2e/cluster/build-bins.sh): for each new connection to or from a managed pod, the kernel
// queues its first packet to this process over NFQUEUE, and upstream's engine
// (pkg/networkpolicy: both directions, every NetworkPolicy of the cluster) gives the verdict.
//
// What is ours, and why:
//   - the queue rules. Upstream programs them with nftables' native `queue` expression, which
//     the local stack's kernel does not have (nft: "No such file or directory"); the kernel has
//     the xtables NFQUEUE target, so the rules are iptables-nft rules in a chain of our own,
//     jumped to from mangle POSTROUTING (where upstream hooks too: after DNAT, before SNAT):
//     sockets of root on the host pass (upstream's `meta skuid 0 accept`: kubelet probes and
//     the host's daemons), then every NEW connection whose source or destination is a managed
//     pod is queued;
//   - which pods are managed. Upstream runs one instance per node, managing that node's pods.
//     On the local stack every node is a network namespace behind the host, so the host's
//     postrouting hook sees all traffic between nodes and from the host: one instance on the
//     host manages the pods of the namespaces named by --namespaces, whatever their node, and
//     a test enforces policies for its own namespaces only, without changing what any other
//     test on the shared cluster sees. The chain name and queue number are flags, so that
//     instances never collide.
//
// Run as root on the host: cas-netpol --kubeconfig K --namespaces a,b --chain C --queue N.
// On SIGTERM it removes its rules, then stops (no rule queues to a queue nobody reads).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	nfqueue "github.com/florianl/go-nfqueue/v2"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	networkinglisters "k8s.io/client-go/listers/networking/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kube-network-policies/pkg/api"
	"sigs.k8s.io/kube-network-policies/pkg/network"
	"sigs.k8s.io/kube-network-policies/pkg/networkpolicy"
	"sigs.k8s.io/kube-network-policies/pkg/podinfo"
)

// rules keeps the queue rules in our chain equal to the managed pods' IPs.
type rules struct {
	chain, queue string
	namespaces   sets.Set[string]
	pods         corelisters.PodLister
	policies     networkinglisters.NetworkPolicyLister
	mu           sync.Mutex
	written      string
}

// managed: the IPs of every pod of the named namespaces that a NetworkPolicy selects.
func (r *rules) managed() []string {
	ips := sets.New[string]()
	for namespace := range r.namespaces {
		found, err := r.policies.NetworkPolicies(namespace).List(labels.Everything())
		if err != nil {
			continue
		}
		for _, policy := range found {
			selector, err := metav1.LabelSelectorAsSelector(&policy.Spec.PodSelector)
			if err != nil {
				continue
			}
			pods, err := r.pods.Pods(namespace).List(selector)
			if err != nil {
				continue
			}
			for _, pod := range pods {
				for _, ip := range pod.Status.PodIPs {
					if !pod.Spec.HostNetwork && !strings.Contains(ip.IP, ":") {
						ips.Insert(ip.IP)
					}
				}
			}
		}
	}
	return sets.List(ips)
}

func iptables(args ...string) error {
	out, err := exec.Command("iptables-nft", append([]string{"-w", "-t", "mangle"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iptables-nft %v: %v: %s", args, err, out)
	}
	return nil
}

// sync rewrites the chain (flushed and filled in one iptables-nft-restore) when the set changed.
func (r *rules) sync() {
	r.mu.Lock()
	defer r.mu.Unlock()
	lines := []string{"*mangle", fmt.Sprintf(":%s - [0:0]", r.chain),
		fmt.Sprintf("-A %s -m owner --uid-owner 0 -j RETURN", r.chain)}
	ips := r.managed()
	for _, ip := range ips {
		for _, side := range []string{"-d", "-s"} {
			lines = append(lines, fmt.Sprintf(
				"-A %s %s %s/32 -m conntrack --ctstate NEW -j NFQUEUE --queue-num %s",
				r.chain, side, ip, r.queue))
		}
	}
	payload := strings.Join(append(lines, "COMMIT", ""), "\n")
	if payload == r.written {
		return
	}
	cmd := exec.Command("iptables-nft-restore", "-w", "--noflush")
	cmd.Stdin = strings.NewReader(payload)
	if out, err := cmd.CombinedOutput(); err != nil {
		klog.Errorf("iptables-nft-restore: %v: %s", err, out)
		return
	}
	r.written = payload
	klog.Infof("cas-netpol: queueing new connections of %d pods: %v", len(ips), ips)
}

func (r *rules) install() error {
	r.sync()
	return iptables("-I", "POSTROUTING", "-j", r.chain)
}

func (r *rules) remove() {
	for _, args := range [][]string{{"-D", "POSTROUTING", "-j", r.chain}, {"-F", r.chain}, {"-X", r.chain}} {
		if err := iptables(args...); err != nil {
			klog.Infof("cas-netpol: %v", err)
		}
	}
}

func (r *rules) onChange(obj interface{}) {
	if tombstone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tombstone.Obj
	}
	if o, ok := obj.(metav1.Object); ok && r.namespaces.Has(o.GetNamespace()) {
		r.sync()
	}
}

// serve gives every queued packet upstream's verdict: accepted, or dropped.
func serve(ctx context.Context, engine *networkpolicy.PolicyEngine, queue uint16) error {
	nf, err := nfqueue.Open(&nfqueue.Config{
		NfQueue:      queue,
		Flags:        nfqueue.NfQaCfgFlagGSO,
		MaxPacketLen: 128, // the headers
		MaxQueueLen:  1024,
		Copymode:     nfqueue.NfQnlCopyPacket,
		WriteTimeout: 100 * time.Millisecond,
	})
	if err != nil {
		return err
	}
	defer nf.Close()
	verdicts := func(a nfqueue.Attribute) int {
		verdict := nfqueue.NfDrop
		packet, err := network.ParsePacket(*a.Payload)
		if err == nil {
			packet.ID = *a.PacketID
			if ok, err := engine.EvaluatePacket(ctx, &packet); err == nil && ok {
				verdict = nfqueue.NfAccept
			}
			klog.V(2).Infof("cas-netpol: %s -> %v", packet.String(), verdict == nfqueue.NfAccept)
		}
		if err := nf.SetVerdict(*a.PacketID, verdict); err != nil {
			klog.Errorf("verdict: %v", err)
		}
		return 0
	}
	failed := func(err error) int {
		klog.Infof("cas-netpol: queue: %v", err)
		return 0
	}
	if err := nf.RegisterWithErrorFunc(ctx, verdicts, failed); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "the cluster's kubeconfig")
	namespaces := flag.String("namespaces", "", "comma-separated namespaces whose pods are managed")
	chain := flag.String("chain", "CASNETPOL", "the iptables-nft mangle chain this instance owns")
	queue := flag.Uint("queue", 100, "the NFQUEUE number this instance reads")
	klog.InitFlags(nil)
	flag.Parse()
	scope := sets.New[string]()
	for _, n := range strings.Split(*namespaces, ",") {
		if n = strings.TrimSpace(n); n != "" {
			scope.Insert(n)
		}
	}
	if scope.Len() == 0 || *queue > 65535 {
		fmt.Fprintln(os.Stderr, "cas-netpol: name at least one namespace, and a queue below 65536")
		os.Exit(2)
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		klog.Fatalf("kubeconfig: %v", err)
	}
	clientset := kubernetes.NewForConfigOrDie(config)
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	factory := informers.NewSharedInformerFactory(clientset, 0)
	nsInformer := factory.Core().V1().Namespaces()
	podInformer := factory.Core().V1().Pods()
	npInformer := factory.Networking().V1().NetworkPolicies()
	resolver, err := podinfo.NewInformerResolver(podInformer.Informer())
	if err != nil {
		klog.Fatalf("pod IP resolver: %v", err)
	}
	provider := podinfo.NewInformerProvider(podInformer, nsInformer, nil, []podinfo.IPResolver{resolver})
	// The node name only scopes upstream's own sync triggers, which nothing reads here.
	standard := networkpolicy.NewStandardNetworkPolicy("", nsInformer, podInformer, npInformer)
	engine := networkpolicy.NewPolicyEngine(provider, []api.PolicyEvaluator{standard})
	r := &rules{chain: *chain, queue: fmt.Sprint(*queue), namespaces: scope,
		pods: podInformer.Lister(), policies: npInformer.Lister()}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    r.onChange,
		UpdateFunc: func(_, cur interface{}) { r.onChange(cur) },
		DeleteFunc: r.onChange,
	}
	for _, informer := range []cache.SharedIndexInformer{podInformer.Informer(), npInformer.Informer()} {
		if _, err := informer.AddEventHandler(handler); err != nil {
			klog.Fatalf("event handler: %v", err)
		}
	}
	factory.Start(ctx.Done())
	if err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true,
		func(context.Context) (bool, error) { return engine.Ready(), nil }); err != nil {
		klog.Fatalf("informers: %v", err)
	}
	served := make(chan error, 1)
	go func() { served <- serve(ctx, engine, uint16(*queue)) }()
	if err := r.install(); err != nil {
		klog.Fatalf("rules: %v", err)
	}
	klog.Infof("cas-netpol: enforcing for the pods of %v (chain %s, queue %d)",
		sets.List(scope), *chain, *queue)
	select {
	case <-ctx.Done():
	case err := <-served:
		klog.Errorf("queue: %v", err)
	}
	r.remove()
}
