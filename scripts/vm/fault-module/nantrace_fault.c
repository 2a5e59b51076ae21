// SPDX-License-Identifier: GPL-2.0
/*
 * nantrace_fault: the VM cluster's test faults (`cargo xtask vm-cluster`), printed by the
 * kernel itself, so that /dev/kmsg records them with facility 0 as it does a driver's own
 * lines. A write into /dev/kmsg from user space is LOG_USER and drains nothing
 * (nantrace/src/klog/writer.rs): this module is the tests' honest way to a real kernel fault.
 *
 * Root only: debugfs (mode 0200), /sys/kernel/debug/nantrace_fault/inject. One command per
 * write, fixed formats, only numbers and a validated PCI address chosen by the writer:
 *   xid DDDD:BB:DD CODE PID        NVRM: Xid (PCI:DDDD:BB:DD): CODE, pid=PID, name=python3, TEXT
 *   aer DDDD:BB:DD.F corrected|nonfatal|fatal
 *                                  pcieport DDDD:BB:DD.F: AER: PCIe Bus Error: severity=...
 * TEXT is NVIDIA's for the codes below (FIELD-NOTES.md), a fixed one for any other. Anything
 * else is refused (EINVAL) and prints nothing.
 */
#include <linux/debugfs.h>
#include <linux/fs.h>
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/string.h>
#include <linux/uaccess.h>

static struct dentry *dir;

static const char *xid_text(unsigned int code)
{
	switch (code) {
	case 13: return "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address";
	case 31: return "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f00_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ";
	case 48: return "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.";
	case 79: return "GPU has fallen off the bus.";
	case 94: return "Contained: SM (0x1). RST: No, D-RST: No";
	case 95: return "Uncontained: FBHUB. RST: Yes, D-RST: No";
	default: return "nantrace_fault test fault.";
	}
}

/* Only blanks after the command's last field. */
static bool rest_blank(const char *s)
{
	return *skip_spaces(s) == '\0';
}

static ssize_t inject_write(struct file *file, const char __user *ubuf, size_t len, loff_t *ppos)
{
	char buf[96], sev[12];
	unsigned int dom, bus, dev, fn, code;
	int pid, n = -1;

	if (len == 0 || len >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, len))
		return -EFAULT;
	buf[len] = '\0';

	if (sscanf(buf, "xid %4x:%2x:%2x %u %d%n", &dom, &bus, &dev, &code, &pid, &n) == 5 &&
	    n > 0 && rest_blank(buf + n) && dev < 32 && code < 100000 && pid > 0) {
		printk(KERN_ERR "NVRM: Xid (PCI:%04x:%02x:%02x): %u, pid=%d, name=python3, %s\n",
		       dom, bus, dev, code, pid, xid_text(code));
		return len;
	}
	n = -1;
	if (sscanf(buf, "aer %4x:%2x:%2x.%1x %11s%n", &dom, &bus, &dev, &fn, sev, &n) == 5 &&
	    n > 0 && rest_blank(buf + n) && dev < 32 && fn < 8) {
		const char *severity, *type, *agent;

		if (!strcmp(sev, "corrected")) {
			severity = "Corrected"; type = "Physical Layer"; agent = "Receiver ID";
		} else if (!strcmp(sev, "nonfatal")) {
			severity = "Uncorrected (Non-Fatal)"; type = "Transaction Layer"; agent = "Requester ID";
		} else if (!strcmp(sev, "fatal")) {
			severity = "Uncorrected (Fatal)"; type = "Inaccessible"; agent = "Unregistered Agent ID";
		} else {
			return -EINVAL;
		}
		printk(KERN_ERR "pcieport %04x:%02x:%02x.%x: AER: PCIe Bus Error: severity=%s, type=%s, (%s)\n",
		       dom, bus, dev, fn, severity, type, agent);
		return len;
	}
	return -EINVAL;
}

static const struct file_operations inject_fops = {
	.owner = THIS_MODULE,
	.write = inject_write,
	.llseek = noop_llseek,
};

static int __init nantrace_fault_init(void)
{
	dir = debugfs_create_dir("nantrace_fault", NULL);
	if (IS_ERR(dir))
		return PTR_ERR(dir);
	debugfs_create_file("inject", 0200, dir, NULL, &inject_fops);
	return 0;
}

static void __exit nantrace_fault_exit(void)
{
	debugfs_remove_recursive(dir);
}

module_init(nantrace_fault_init);
module_exit(nantrace_fault_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("nantrace's VM cluster: test faults (NVRM Xid, PCIe AER) printed by the kernel");
